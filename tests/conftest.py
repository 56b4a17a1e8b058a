"""What every test shares: tiny random-weight checkpoints, engines over them, and the test device."""

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede any import of triton
# FlexAttention's compiled kernels (tests/train/test_prompt_tree.py) go to one place, not /tmp/torchinductor_<user>
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "braid-inductor"))

import pytest  # noqa: E402

from braid.engine import Engine, EngineConfig  # noqa: E402
from braid.models.checkpoints import make_random_checkpoint  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]

# The tests sit in folders that mirror the rooms (tests/engine for engine/, ...); a test may reuse another room's
# helpers by module name (`from test_calibration import answer`) whichever files were collected, as the device
# script's single files do: every room's folder is importable.
sys.path[:0] = sorted(str(p) for p in Path(__file__).parent.iterdir()
                      if p.is_dir() and not p.name.startswith((".", "_")))

# BRAID_TEST_DEVICE=cuda runs every engine the tests build on that device, in fp32 so the exactness tests hold
# (a lent GPU's check of the engine; CI runs on CPU and leaves this unset).
if os.environ.get("BRAID_TEST_DEVICE"):
    _resolved = EngineConfig.resolved

    def _on_test_device(self):
        return _resolved(replace(self, device=os.environ["BRAID_TEST_DEVICE"] if self.device == "auto" else self.device,
                                 dtype="float32" if self.dtype == "auto" else self.dtype))

    EngineConfig.resolved = _on_test_device


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(family, **config overrides) -> path of a saved tiny random-weight model."""
    made = {}

    def make(family="llama", seed=0, **overrides):
        key = (family, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"{family}-ckpt")
            made[key] = make_random_checkpoint(str(path), family, "tiny", seed=seed, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def llama_engine(checkpoint):
    return Engine(EngineConfig(checkpoint("llama")))


@pytest.fixture(scope="session", params=FAMILIES)
def family_engine(request, checkpoint):
    return Engine(EngineConfig(checkpoint(request.param)))


@pytest.fixture
def fresh_engine(checkpoint):
    """An engine with its own empty store, for tests that inspect the store."""
    return Engine(EngineConfig(checkpoint("llama")))


def _data_mib() -> int:
    """This process's private data mappings (VmData), MiB: what a fork must be able to commit."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmData:"))


_collected_at = [0]  # VmData (MiB) after this process's last collection


@pytest.fixture(autouse=True)
def _engines_collected():
    """Engines a test let go of are freed before they pile up: each maps its KV pool (about 2.3 GiB untouched on
    CPU), and an engine in a reference cycle waits for a full collection, which allocations of a few large tensors
    never trigger. Left alone they reach 36 GiB over a few test files, and the process can no longer fork (Ray
    starts its processes by fork: ENOMEM under the kernel's overcommit heuristic). A full collection costs a few
    tenths of a second here, so it runs only once the mappings have grown 3 GiB past the last one's."""
    yield
    if _data_mib() > max(4096, _collected_at[0] + 3072):
        import gc

        gc.collect()
        _collected_at[0] = _data_mib()
