"""One validated configuration for the whole cluster; each deployment gets the part it needs."""

import os
from dataclasses import dataclass

from braid.api.service import ServiceConfig
from braid.api.workflow import TRANSPORTS, WorkflowConfig
from braid.engine import EngineConfig
from braid.models.chat import WORKER_HEADER
from braid.synthesizer.runner import SynthesizerConfig
from braid.workers.runner import WorkerConfig


@dataclass
class ClusterConfig:
    model_path: str
    colocate: bool = False  # one engine per replica runs workers and synthesis: KV reused in place, no copy
    worker_replicas: int = 1
    synthesizer_replicas: int = 1
    gpus_per_worker: float | None = None  # None: 1 when CUDA is visible, else 0 (CPU)
    gpus_per_synthesizer: float | None = None
    dtype: str = "auto"
    # the synthesizer's calibration (braid calibrate): "auto" loads <model_path>/calibration when it is there;
    # "none" runs the cache path uncalibrated (then kv_transport=auto re-prefills text)
    calibration: str = "auto"
    store_budget_bytes: int = 2 << 30
    kv_budget_bytes: int = 0  # each engine's work KV for the calls it batches at once (more wait); 0: auto
    max_batched_tokens: int = 512  # rows per forward of each engine's scheduler
    # calls one replica takes at once (Serve's max_ongoing_requests): its scheduler batches them
    max_ongoing_requests: int = 64
    kv_transport: str = "auto"  # auto: grpc or text per request, from measured bandwidth vs prefill throughput;
    # collective: NCCL between GPUs (gloo on CPU)
    kv_chunk_bytes: int = 1 << 20  # under gRPC's 4 MiB default message limit
    kv_schedule: tuple[int, ...] = (8, 128, 256)  # staircase: ship after 8 tokens, then every 128, then 256
    kv_wait_timeout_s: float = 120.0  # a started branch's KV may go this long without a chunk
    kv_queue_timeout_s: float = 3600.0  # a branch may wait this long for a worker to start on it
    default_max_tokens: int = 128
    max_branches: int = 16
    redis_url: str | None = None  # None: the embedded server
    grpc_port: int = 9000
    session_ttl_s: int = 3600
    worker_header: str = WORKER_HEADER  # opens each worker's answer (the reference model's chat role)

    def __post_init__(self):
        if not os.path.isfile(os.path.join(self.model_path, "config.json")):
            raise ValueError(f"model_path {self.model_path!r} holds no checkpoint (no config.json)")
        for name in ("worker_replicas", "synthesizer_replicas", "store_budget_bytes", "session_ttl_s",
                     "max_ongoing_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"kv_transport {self.kv_transport!r} is not one of {TRANSPORTS}")
        if not 0 < self.grpc_port < 65536:
            raise ValueError(f"grpc_port {self.grpc_port} is not a port number")
        # The parts validate themselves: a bad value fails here, not in a replica.
        self.engine_config(), self.worker_config(), self.synthesizer_config(), self.workflow_config()
        self.service_config()

    def engine_config(self, role: str = "synthesizer") -> EngineConfig:
        """Each replica's engine: the device is picked where it runs ("auto": CUDA when visible). Only the
        synthesizer's engine (colocated: the one engine) loads the calibration; workers run the base model."""
        return EngineConfig(self.model_path, dtype=self.dtype, device="auto",
                            store_budget_bytes=self.store_budget_bytes, kv_budget_bytes=self.kv_budget_bytes,
                            max_batched_tokens=self.max_batched_tokens,
                            calibration=self.calibration if role == "synthesizer" else "none")

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(self.worker_header, self.kv_chunk_bytes, tuple(self.kv_schedule))

    def synthesizer_config(self) -> SynthesizerConfig:
        return SynthesizerConfig(self.kv_wait_timeout_s, self.kv_queue_timeout_s)

    def service_config(self) -> ServiceConfig:
        return ServiceConfig(default_max_tokens=self.default_max_tokens)

    def workflow_config(self) -> WorkflowConfig:
        return WorkflowConfig(self.kv_transport, self.colocate,
                              self.synthesizer_replicas if self.colocate else self.worker_replicas,
                              self.default_max_tokens, self.max_branches, self.worker_header)
