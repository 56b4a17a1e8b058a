"""`python -m braid` is the `braid` command."""

import sys

from braid.cli import main

sys.exit(main())
