"""The reference model's room: its committed checkpoint, chat template and tasks, and random test checkpoints."""

import os

# The reference model trained by braid.train and committed with the repository.
REFERENCE_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "braid-reference")
