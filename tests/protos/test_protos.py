"""The committed stubs are what `python -m braid.protos.generate` would write now."""

import os

from braid.protos.generate import HERE, generate


def test_committed_stubs_are_current(tmp_path):
    written = generate(str(tmp_path))
    assert written, "protoc wrote nothing"
    for path in written:
        committed = os.path.join(HERE, os.path.basename(path))
        assert os.path.exists(committed), f"{os.path.basename(path)} is not committed: run python -m braid.protos.generate"
        with open(path, "rb") as new, open(committed, "rb") as old:
            assert new.read() == old.read(), f"{os.path.basename(path)} is stale: run python -m braid.protos.generate"
