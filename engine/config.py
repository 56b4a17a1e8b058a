"""Engine configuration: one validated dataclass."""

import contextlib
import contextvars
import os
import re
from dataclasses import dataclass, replace

import torch

CALIBRATION_MANIFEST = "calibration.json"  # (methods.calibration.MANIFEST)
# named verifications of a calibration, beside its manifest: <calibration>/verifications/<name>.json (braid eval
# --verify --verification NAME); OWN_VERIFICATION is the one in its manifest
VERIFICATIONS_DIR = "verifications"
OWN_VERIFICATION = "own"
DECODE_GRAPHS = ("auto", "off", "eager")  # (engine.cuda_graphs)
ATTENTION = ("sdpa", "flex", "paged")  # (engine.attention)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_PATHS_HERE = contextvars.ContextVar("braid_paths_here", default=True)


@contextlib.contextmanager
def paths_elsewhere():
    """Validate configs without looking for their files: they are on the machines that will run them (a
    Kubernetes pod's volume), not on this one. Every other check still runs."""
    token = _PATHS_HERE.set(False)
    try:
        yield
    finally:
        _PATHS_HERE.reset(token)


def paths_here() -> bool:
    return _PATHS_HERE.get()


def verification_file(calibration: str, name: str) -> str:
    """Where the verification `name` of the calibration directory `calibration` is stored (not OWN_VERIFICATION,
    which is in its manifest); a ValueError for a name that is no plain file name."""
    if name == OWN_VERIFICATION or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", name):
        raise ValueError(f"verification {name!r} must be {OWN_VERIFICATION!r} (the calibration's own, in its "
                         "manifest) or a name of letters, digits, '.', '_' and '-' (up to 100, not starting with "
                         "'.', '_' or '-')")
    return os.path.join(calibration, VERIFICATIONS_DIR, f"{name}.json")


def verification_names(calibration: str) -> list[str]:
    """The named verifications recorded beside a calibration directory."""
    folder = os.path.join(calibration, VERIFICATIONS_DIR)
    return sorted(f.removesuffix(".json") for f in os.listdir(folder) if f.endswith(".json")) \
        if os.path.isdir(folder) else []


@dataclass
class EngineConfig:
    model_path: str
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # "auto": cuda if available, else cpu
    store_budget_bytes: int = 2 << 30  # message store capacity (KV bytes)
    max_parallel_calls: int = 64
    max_batched_tokens: int = 512  # rows per forward across all running calls (the scheduler's step budget)
    # work KV of the calls running at once (more wait their turn), allocated when the engine starts; 0: auto,
    # 256 MiB on CPU, half the device memory free after loading the model on CUDA
    kv_budget_bytes: int = 0
    kv_block_tokens: int = 16  # the work KV's page size: a call holds whole blocks of the pool
    max_running_requests: int = 0  # requests batched at once (0: as many as the KV budget holds; 1: serial)
    # when the work KV is short, a decode call is admitted with blocks for what it holds and takes more as it
    # decodes (preempted, and encoded again later, when none are left); false: every call waits until its whole
    # max_tokens fits (engine.scheduler)
    kv_on_demand: bool = True
    # a parent placed where it was encoded is read in place: one copy in the work KV for every running call
    # that reads it so (false: each call copies its parents into its own blocks)
    share_parents: bool = True
    # where stored messages' KV lives: "paged", in the work KV's pool itself, in the blocks the call wrote
    # (engine.store.PagedKV): storing copies nothing, a call reads a parent placed where it was encoded in place,
    # and only a parent read at another offset gets a re-rotated copy; the pool then holds kv_budget_bytes of work
    # KV and store_budget_bytes of stored messages. "dense": a tensor of its own per message (a finished call's KV
    # is copied out of the work KV, and copied back in by each call that reads it, unless shared as above)
    kv_home: str = "paged"
    # base-weight calls share a forward with an adapter's calls (a calibration's LoRA), which reads its merged
    # weights on its own rows only; false: they take turns, a forward each (engine.scheduler). Forwards that may
    # run as CUDA graphs take turns either way: a graph swaps one set of weights in over every row
    mix_adapters: bool = True
    prefix_caching: bool = True  # reuse encoded messages across requests (engine.prefix_cache)
    prefix_block_tokens: int = 16  # its hash granularity: a cached start is reused in whole blocks
    # a calibration directory written by `braid calibrate`, attached by methods.calibration.load_engine (the engine
    # itself never reads it); "auto": the model's own <model_path>/calibration when it has one; "none": uncalibrated
    calibration: str = "auto"
    # which verification of the calibration `auto` transport trusts (the synthesizer's gate: up to how many branches,
    # of how many tokens, at which placement): "own", the one in its manifest; a name, the one `braid eval --verify
    # --verification NAME` wrote beside it, in <calibration>/verifications/NAME.json
    verification: str = OWN_VERIFICATION
    # decode steps at static, bucketed shapes replayed as CUDA graphs (engine.cuda_graphs): "auto": on CUDA, off on
    # CPU; "off"; "eager": the static shapes without graphs (what the graphs replay; for tests on CPU)
    decode_graphs: str = "auto"
    # how a forward's attention reads the work KV (engine.attention): "sdpa", each request's keys gathered out of the
    # pool (the default, and the reference); "flex", FlexAttention over the pool in place, through a block mask
    # built from the requests' page tables (compiled on CUDA; eager on CPU, where it is slower). Forwards then run as
    # they come: decode_graphs capture the sdpa path only; "paged", as sdpa, but decode-sized requests' attention
    # reads their keys where they lie in the pool, through their slot tables (kernels.paged_decode, Triton; CUDA
    # graphs capture it; on CPU only under Triton's interpreter, as the tests run it)
    attention: str = "sdpa"
    # build and launch each step before reading the tokens the step before sampled (engine.scheduler): on CUDA the
    # host's work of a step (scheduling, inputs, reading tokens, detokenizing) then runs while the device runs the
    # step before, at the cost of one discarded draw for a call that stops on a stop token. Each call gets the
    # tokens it would get step by step wherever the kernels give a row the same result in any batch (the CPU
    # tests); on a GPU the batches differ, so rare near-ties may not. Off by default until a GPU run measures it
    # (benchmarks/device_run.sh); on CPU it cannot pay
    overlap: bool = False
    # base-weight forwards run the decoder through torch.compile (inductor): one graph for every row count, the norms,
    # rotary embeddings and activations between the attention ops fused into fewer kernels (on CUDA, fewer launches
    # for a forward run as it comes and for each decode graph's replay). Attention and the KV writes stay as they are,
    # one op per layer the compiler does not look into (engine.attention.step_attention). The first forwards
    # compile (seconds to minutes, logged); a model that does not compile runs as it comes. Adapter forwards run as
    # they come. Off by default until a GPU run measures it (benchmarks/device_run.sh); on CPU it compiles C++
    compile: bool = False
    # intra-op threads of the forwards on CPU, set in the scheduler's thread; 0: as many as the thread making the
    # engine has (torch's default: the cores). The engine keeps the scheduler's thread the only one with several
    # (engine.threads: libgomp slows every pool down once the process's pooled threads outnumber the cores), so a
    # process that also runs heavy torch work of its own beside the engine (training) should give it 1
    # (benchmarks/cpu_threads.py measures the settings). Not used on CUDA.
    cpu_threads: int = 0

    def __post_init__(self):
        if paths_here() and not os.path.isdir(self.model_path):
            raise ValueError(f"model_path {self.model_path!r} is not a directory holding a checkpoint")
        if paths_here() and not os.path.isfile(os.path.join(self.model_path, "config.json")):
            raise ValueError(f"model_path {self.model_path!r} has no config.json")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of auto, {', '.join(DTYPES)}")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"device {self.device!r} must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for but CUDA is not available")
        if self.store_budget_bytes <= 0:
            raise ValueError(f"store_budget_bytes must be positive, got {self.store_budget_bytes}")
        for name in ("max_parallel_calls", "max_batched_tokens", "prefix_block_tokens", "kv_block_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_budget_bytes < 0:
            raise ValueError(f"kv_budget_bytes must be >= 0 (0: auto), got {self.kv_budget_bytes}")
        for name in ("share_parents", "kv_on_demand", "mix_adapters", "overlap", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.cpu_threads, int) or self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be an int >= 0 (0: the count of the thread making the engine), "
                             f"got {self.cpu_threads!r}")
        if self.max_running_requests < 0:
            raise ValueError(f"max_running_requests must be >= 0 (0: no limit), got {self.max_running_requests}")
        if self.kv_home not in ("dense", "paged"):
            raise ValueError(f"kv_home must be dense or paged, got {self.kv_home!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention {self.attention!r} is not one of {', '.join(ATTENTION)}")
        if self.decode_graphs not in DECODE_GRAPHS:
            raise ValueError(f"decode_graphs {self.decode_graphs!r} is not one of {', '.join(DECODE_GRAPHS)}")
        manifest = os.path.join(self.calibration, CALIBRATION_MANIFEST)
        if paths_here() and self.calibration not in ("auto", "none") and not os.path.isfile(manifest):
            raise ValueError(f"calibration {self.calibration!r} is not a directory written by `braid calibrate` "
                             f"(no {CALIBRATION_MANIFEST}); give one, 'auto' or 'none'")
        if self.verification != OWN_VERIFICATION:
            self._check_verification()

    def _check_verification(self) -> None:
        """A named verification: a well-formed name, of a calibration that is loaded, recorded beside it."""
        verification_file("", self.verification)  # (the name's form)
        calibration = self._calibration_here() if paths_here() else self.calibration
        if calibration == "none":
            raise ValueError(f"verification {self.verification!r} names a verification of a calibration, and "
                             f"calibration is {self.calibration!r}" + (" (the model has none of its own)"
                                                                       if self.calibration == "auto" else ""))
        if paths_here() and not os.path.isfile(verification_file(calibration, self.verification)):
            recorded = verification_names(calibration)
            raise ValueError(f"verification {self.verification!r} is not recorded beside calibration {calibration} "
                             f"(no {verification_file(calibration, self.verification)}); recorded there: "
                             f"{', '.join(recorded) or 'none'} besides {OWN_VERIFICATION!r}, the one in its manifest. "
                             f"`braid eval --verify --verification {self.verification}` writes it")

    def resolved(self) -> "EngineConfig":
        """This config on this machine: "auto" device and dtype made concrete (the engine calls it, so a
        config built on a CPU-only head resolves on the GPU replica that runs it)."""
        device = ("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device
        dtype = ("bfloat16" if device.startswith("cuda") else "float32") if self.dtype == "auto" else self.dtype
        return replace(self, device=device, dtype=dtype, calibration=self._calibration_here())

    def _calibration_here(self) -> str:
        """The calibration directory on this machine ("auto": the model's own when it has one, else "none")."""
        if self.calibration != "auto":
            return self.calibration
        own = os.path.join(self.model_path, "calibration")
        return own if os.path.isfile(os.path.join(own, CALIBRATION_MANIFEST)) else "none"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.resolved().dtype]
