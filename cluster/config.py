"""One validated configuration for the whole cluster; each deployment gets the part it needs."""

import dataclasses
import os
import types
import typing
from dataclasses import dataclass

from braid.api.workflow import TRANSPORTS, WorkflowConfig
from braid.engine import EngineConfig
from braid.engine.config import ATTENTION, DECODE_GRAPHS, OWN_VERIFICATION, paths_elsewhere, paths_here
from braid.kv.connector import Transport
from braid.methods.kvcomm import KVCommConfig
from braid.methods.staircase import StaircaseSchedule
from braid.models.chat import WORKER_HEADER
from braid.runtime.quotas import KeyLimits
from braid.runtime.sessions import ServiceConfig
from braid.synthesizer.runner import SynthesizerConfig
from braid.workers.runner import WorkerConfig

# fields that must be >= 1 (checked here and in the JSON Schema the Helm chart's values are checked against)
AT_LEAST_ONE = ("worker_replicas", "synthesizer_replicas", "store_budget_bytes", "session_ttl_s",
                "max_ongoing_requests", "max_batched_tokens", "default_max_tokens", "max_branches")


@dataclass
class Autoscaling:
    """Serve autoscaling for one deployment: replicas between min and max, aiming at this many calls each."""
    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float = 16.0

    @classmethod
    def from_dict(cls, values: dict, name: str) -> "Autoscaling":
        fields = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(values, dict) or set(values) - fields or not {"min_replicas", "max_replicas"} <= set(values):
            raise ValueError(f"{name} takes min_replicas and max_replicas (and optionally target_ongoing_requests), "
                             f"got {values!r}")
        return cls(**values)

    def __post_init__(self):
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"autoscaling needs 1 <= min_replicas <= max_replicas, got {self.min_replicas} and "
                             f"{self.max_replicas} (a session's messages live on a synthesizer replica, so never 0)")
        if self.target_ongoing_requests <= 0:
            raise ValueError(f"autoscaling target_ongoing_requests must be > 0, got {self.target_ongoing_requests}")


@dataclass
class ClusterConfig:
    model_path: str
    colocate: bool = False  # one engine per replica runs workers and synthesis: KV reused in place, no copy
    worker_replicas: int = 1
    synthesizer_replicas: int = 1
    # None: 1 when CUDA is visible where the app is built, else 0 (set it when that node may differ from the replicas')
    gpus_per_worker: float | None = None
    gpus_per_synthesizer: float | None = None
    dtype: str = "auto"
    # the synthesizer's calibration (braid calibrate): "auto" loads <model_path>/calibration when it is there;
    # "none" runs the cache path uncalibrated (then kv_transport=auto re-prefills text)
    calibration: str = "auto"
    # which of the calibration's verifications `auto` transport trusts: "own", the one in its manifest; a name, the one
    # `braid eval --verify --verification NAME` recorded beside it (<calibration>/verifications/NAME.json)
    verification: str = OWN_VERIFICATION
    store_budget_bytes: int = 2 << 30
    kv_budget_bytes: int = 0  # each engine's work KV for the calls it batches at once (more wait); 0: auto
    max_batched_tokens: int = 512  # rows per forward of each engine's scheduler
    cpu_threads: int = 0  # on CPU, each engine's intra-op threads (EngineConfig); 0: the process's (the cores)
    overlap: bool = False  # each engine builds a step while the device runs the one before (EngineConfig.overlap)
    compile: bool = False  # each engine's base-weight forwards through torch.compile (EngineConfig.compile)
    # how each engine's attention reads the work KV: "sdpa" (keys gathered), "flex" (in place, through page tables)
    # or "paged" (decode attention through slot tables, Triton)
    attention: str = "sdpa"  # (EngineConfig.attention)
    decode_graphs: str = "auto"  # static decode shapes replayed as CUDA graphs: auto (on CUDA), off, eager
    # calls one replica takes at once (Serve's max_ongoing_requests): its scheduler batches them
    max_ongoing_requests: int = 64
    kv_transport: str = "auto"  # auto: grpc or text per request, from measured bandwidth vs prefill throughput;
    # collective: NCCL between GPUs (gloo on CPU)
    kv_chunk_bytes: int = 1 << 20  # under gRPC's 4 MiB default message limit
    kv_schedule: tuple[int, ...] = (8, 128, 256)  # staircase: ship after 8 tokens, then every 128, then 256
    # RunGraph staircase nodes (unless a request says otherwise): the parents' chunks are kv_schedule's sizes;
    # the staircase node answers in chunks of these sizes, and its first round waits for all parents but
    # `staircase_redundancy` of them
    staircase_aggregator: tuple[int, ...] = (8, 128)
    staircase_redundancy: int = 0
    kv_wait_timeout_s: float = 120.0  # a started branch's KV may go this long without a chunk
    kv_queue_timeout_s: float = 3600.0  # a branch may wait this long for a worker to start on it
    # RunGraph decodes its nodes on the Worker replicas (each wave dealt over them, parents and outputs moved
    # as KV); false, or colocated: on the session's Synthesizer replica, each wave in one batch
    graph_on_workers: bool = True
    # the cache path re-encodes this many tokens at each end of every shipped branch, with the earlier branches
    # in view (methods.synthesis.Refresh); 0: off; unset: as the loaded calibration was trained (its manifest),
    # one without a calibration
    refresh_tokens: int | None = None
    default_max_tokens: int = 128
    max_branches: int = 16
    redis_url: str | None = None  # None: the embedded server
    grpc_port: int = 9000
    session_ttl_s: int = 3600
    worker_header: str = WORKER_HEADER  # opens each worker's answer (the reference model's chat role)
    # record what RunWorkflow and RunGraph serve, one JSON line per request, in this directory (runtime.traces; "": off)
    record_dir: str = ""
    # Serve autoscaling instead of a fixed replica count (then *_replicas is ignored)
    worker_autoscaling: Autoscaling | None = None
    synthesizer_autoscaling: Autoscaling | None = None
    # custom Ray resources each replica needs: pins a deployment to the nodes that offer them (a node group)
    worker_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    synthesizer_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    api_keys_file: str | None = None  # API keys the agent API accepts (braid.api.auth); None: the API is open
    # what each API key may hold at once (0: no limit): open sessions, KV bytes in them, running workflows
    key_max_sessions: int = 0
    key_max_store_bytes: int = 0
    key_max_workflows: int = 0
    # KVComm (RunAgents): the entropy threshold gamma (0: never reuse), anchors per placeholder pool (V), and
    # the fraction of a reused text re-encoded, its tokens with the least certain offsets (0: KVComm's method)
    kvcomm_gamma: float = KVCommConfig.gamma
    kvcomm_capacity: int = 20
    kvcomm_recompute: float = KVCommConfig.recompute

    def __post_init__(self):
        if paths_here() and not os.path.isfile(os.path.join(self.model_path, "config.json")):
            raise ValueError(f"model_path {self.model_path!r} holds no checkpoint (no config.json)")
        for name in AT_LEAST_ONE:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url {self.redis_url!r} must start with redis://, rediss:// or unix://")
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"kv_transport {self.kv_transport!r} is not one of {TRANSPORTS}")
        self.key_limits()  # (validates)
        if self.refresh_tokens is not None and self.refresh_tokens < 0:
            raise ValueError(f"refresh_tokens must be >= 0 (0: off) or unset, got {self.refresh_tokens}")
        for name in ("gpus_per_worker", "gpus_per_synthesizer"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (or unset: 1 when CUDA is visible), got {getattr(self, name)}")
        for name in ("worker_autoscaling", "synthesizer_autoscaling"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), Autoscaling):
                setattr(self, name, Autoscaling.from_dict(getattr(self, name), name))
        for name in ("worker_resources", "synthesizer_resources"):
            bad = {k: v for k, v in getattr(self, name).items()
                   if isinstance(v, bool) or not (isinstance(v, (int, float)) and v > 0)}
            if bad:
                raise ValueError(f"{name} must map resource names to amounts > 0, got {bad}")
        if paths_here() and self.api_keys_file is not None and not os.path.isfile(self.api_keys_file):
            raise ValueError(f"api_keys_file {self.api_keys_file!r} does not exist")
        self.kv_schedule, self.staircase_aggregator = tuple(self.kv_schedule), tuple(self.staircase_aggregator)
        if not 0 < self.grpc_port < 65536:
            raise ValueError(f"grpc_port {self.grpc_port} is not a port number")
        # The parts validate themselves: a bad value fails here, not in a replica.
        self.engine_config(), self.worker_config(), self.synthesizer_config(), self.workflow_config()
        self.service_config()

    @classmethod
    def from_dict(cls, values: dict, local_paths: bool = True) -> "ClusterConfig":
        """From plain values (a YAML or JSON file, Serve's application args); an unknown name is refused.
        `local_paths=False`: the model and key files are on the machines that will run it, not on this one."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown cluster config field(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        if local_paths:
            return cls(**values)
        with paths_elsewhere():
            return cls(**values)

    @classmethod
    def json_schema(cls) -> dict:
        """The JSON Schema of the fields (the Helm chart's `config` values are checked against it)."""
        hints = typing.get_type_hints(cls)
        props = {f.name: _schema(hints[f.name]) for f in dataclasses.fields(cls)}
        for name in AT_LEAST_ONE:
            props[name]["minimum"] = 1
        for name in ("worker_autoscaling", "synthesizer_autoscaling"):
            scaling = props[name]["anyOf"][0]["properties"]
            scaling["min_replicas"]["minimum"] = scaling["max_replicas"]["minimum"] = 1
            scaling["target_ongoing_requests"]["exclusiveMinimum"] = 0
        for name in ("gpus_per_worker", "gpus_per_synthesizer", "refresh_tokens"):
            props[name]["anyOf"][0]["minimum"] = 0
        props["grpc_port"].update(minimum=1, maximum=65535)
        props["kv_transport"]["enum"] = list(TRANSPORTS)
        props["attention"]["enum"], props["decode_graphs"]["enum"] = list(ATTENTION), list(DECODE_GRAPHS)
        props["kvcomm_gamma"].update(minimum=0, maximum=1)
        props["kvcomm_capacity"]["minimum"] = 0
        props["cpu_threads"]["minimum"] = 0
        props["kvcomm_recompute"].update(minimum=0, maximum=1)
        return {"type": "object", "additionalProperties": False, "required": ["model_path"], "properties": props}

    def engine_config(self, role: str = "synthesizer") -> EngineConfig:
        """Each replica's engine: the device is picked where it runs ("auto": CUDA when visible). Only the
        synthesizer's engine (colocated: the one engine) loads the calibration; workers run the base model."""
        return EngineConfig(self.model_path, dtype=self.dtype, device="auto",
                            store_budget_bytes=self.store_budget_bytes, kv_budget_bytes=self.kv_budget_bytes,
                            max_batched_tokens=self.max_batched_tokens, cpu_threads=self.cpu_threads,
                            overlap=self.overlap, compile=self.compile, attention=self.attention,
                            decode_graphs=self.decode_graphs,
                            calibration=self.calibration if role == "synthesizer" else "none",
                            verification=self.verification if role == "synthesizer" else OWN_VERIFICATION)

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(self.worker_header, self.kv_chunk_bytes, tuple(self.kv_schedule))

    def synthesizer_config(self) -> SynthesizerConfig:
        graph_calls = 0
        if self.graph_on_workers and not self.colocate:
            graph_calls = self.worker_autoscaling.max_replicas if self.worker_autoscaling else self.worker_replicas
        return SynthesizerConfig(self.kv_wait_timeout_s, self.kv_queue_timeout_s, self.refresh_tokens, graph_calls,
                                 Transport.COLLECTIVE if self.kv_transport == "collective" else Transport.GRPC)

    def service_config(self) -> ServiceConfig:
        return ServiceConfig(default_max_tokens=self.default_max_tokens,
                             kvcomm=KVCommConfig(gamma=self.kvcomm_gamma, capacity=self.kvcomm_capacity,
                                                 recompute=self.kvcomm_recompute),
                             limits=self.key_limits(), staircase=self.staircase_schedule())

    def staircase_schedule(self) -> StaircaseSchedule:
        """Staircases' default schedule (RunGraph's and RunWorkflow's): the parents' chunks are the sizes
        the workers ship KV in."""
        return StaircaseSchedule(self.kv_schedule, self.staircase_aggregator, self.staircase_redundancy, strict=False)

    def workflow_config(self) -> WorkflowConfig:
        # a workflow's branches are split into one call per replica that can run them (batched on each)
        replicas, scaling = ((self.synthesizer_replicas, self.synthesizer_autoscaling) if self.colocate
                             else (self.worker_replicas, self.worker_autoscaling))
        return WorkflowConfig(self.kv_transport, self.colocate, scaling.max_replicas if scaling else replicas,
                              self.default_max_tokens, self.max_branches, self.worker_header, self.key_limits(),
                              self.staircase_schedule(), self.record_dir)

    def key_limits(self) -> KeyLimits:
        return KeyLimits(self.key_max_sessions, self.key_max_store_bytes, self.key_max_workflows)


def _schema(hint) -> dict:
    """JSON Schema of one field's type hint."""
    if dataclasses.is_dataclass(hint):
        hints, fields = typing.get_type_hints(hint), dataclasses.fields(hint)
        return {"type": "object", "additionalProperties": False,
                "properties": {f.name: _schema(hints[f.name]) for f in fields},
                "required": [f.name for f in fields if f.default is dataclasses.MISSING]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [_schema(a) for a in args if a is not type(None)]
        return {"anyOf": [*inner, {"type": "null"}]} if type(None) in args else {"anyOf": inner}
    if origin is tuple:
        return {"type": "array", "items": _schema(args[0])}
    if origin is dict:
        return {"type": "object", "additionalProperties": _schema(args[1])}
    return {str: {"type": "string"}, int: {"type": "integer"}, float: {"type": "number"},
            bool: {"type": "boolean"}}[hint]
