"""One validated configuration for the whole cluster."""

import os
from dataclasses import dataclass

from braid.engine import EngineConfig
from braid.models.chat import WORKER_HEADER

TRANSPORTS = ("auto", "grpc", "collective", "text")


@dataclass
class ClusterConfig:
    model_path: str
    colocate: bool = False  # one engine per replica runs workers and synthesis: KV reused in place, no copy
    worker_replicas: int = 1
    synthesizer_replicas: int = 1
    gpus_per_worker: float | None = None  # None: 1 when CUDA is visible, else 0 (CPU)
    gpus_per_synthesizer: float | None = None
    dtype: str = "auto"
    store_budget_bytes: int = 2 << 30
    kv_transport: str = "auto"  # auto: grpc or text per request, from measured bandwidth vs prefill throughput;
    # collective: NCCL between GPUs (gloo on CPU)
    kv_chunk_bytes: int = 1 << 20  # under gRPC's 4 MiB default message limit
    kv_schedule: tuple[int, ...] = (8, 128, 256)  # staircase: ship after 8 tokens, then every 128, then 256
    kv_wait_timeout_s: float = 120.0
    default_max_tokens: int = 128
    max_branches: int = 16
    redis_url: str | None = None  # None: the embedded server
    grpc_port: int = 9000
    session_ttl_s: int = 3600
    worker_header: str = WORKER_HEADER  # opens each worker's answer (the reference model's chat role)

    def __post_init__(self):
        if not os.path.isfile(os.path.join(self.model_path, "config.json")):
            raise ValueError(f"model_path {self.model_path!r} holds no checkpoint (no config.json)")
        for name in ("worker_replicas", "synthesizer_replicas", "default_max_tokens", "max_branches",
                     "kv_chunk_bytes", "store_budget_bytes", "session_ttl_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"kv_transport {self.kv_transport!r} is not one of {TRANSPORTS}")
        if not self.kv_schedule or any(s < 1 for s in self.kv_schedule):
            raise ValueError(f"kv_schedule must be positive token counts, got {self.kv_schedule}")
        if not 0 < self.grpc_port < 65536:
            raise ValueError(f"grpc_port {self.grpc_port} is not a port number")
        if self.kv_wait_timeout_s <= 0:
            raise ValueError(f"kv_wait_timeout_s must be positive, got {self.kv_wait_timeout_s}")

    def engine_config(self, device: str) -> EngineConfig:
        return EngineConfig(self.model_path, dtype=self.dtype, device=device,
                            store_budget_bytes=self.store_budget_bytes)

    def ship_after(self, shipped_chunks: int) -> int:
        """Tokens to accumulate before the next KV chunk (the last step repeats)."""
        return self.kv_schedule[min(shipped_chunks, len(self.kv_schedule) - 1)]
