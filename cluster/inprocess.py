"""The agent API in one process on one engine, over a plain gRPC server (no Ray): both roles share the
engine, so a workflow's branches reach the synthesis by the local transport."""

from dataclasses import dataclass

from braid.api.auth import ApiKeys
from braid.api.grpc_server import AgentServer, start_server
from braid.api.sessions import SessionAPI
from braid.api.workflow import ThreadRoles, WorkflowConfig, WorkflowDriver
from braid.engine import Engine
from braid.kv.receiver import KVReceiver
from braid.models.chat import chat_renderer
from braid.runtime.directory import Directory
from braid.runtime.sessions import ServiceConfig, Sessions
from braid.runtime.traces import TraceRecorder
from braid.synthesizer.runner import SynthesisRunner, SynthesizerConfig
from braid.workers.runner import BranchRunner, WorkerConfig


@dataclass
class InProcessServer:
    server: AgentServer
    port: int
    sessions: Sessions
    receiver: KVReceiver
    recorder: TraceRecorder | None = None  # (record_dir)

    def stop(self) -> None:
        self.server.stop(0)
        self.receiver.stop()
        self.sessions.stop_upkeep()
        if self.recorder is not None:
            self.recorder.close()  # (what is queued is written)


def start_in_process(engine: Engine, directory: Directory, service: ServiceConfig | None = None,
                     worker: WorkerConfig | None = None, synthesizer: SynthesizerConfig | None = None,
                     host: str = "127.0.0.1", port: int = 0, grpc_threads: int = 64,
                     keys: ApiKeys | None = None, tls: tuple[str, str] | None = None,
                     record_dir: str = "") -> InProcessServer:
    """`grpc_threads`: RPCs served at once (each streaming RPC holds one while it runs); `keys`: the API keys
    every RPC must carry (None: open); `tls`: (certificate chain, private key) PEM files; `record_dir`: record
    every workflow served there (runtime.traces)."""
    sessions = Sessions(engine, directory, service)
    sessions.start_upkeep(host)  # (frees the KV of sessions closed or expired)
    receiver = KVReceiver(engine.fingerprint, host=host)
    synth = SynthesisRunner(engine, receiver, sessions, synthesizer or SynthesizerConfig())
    branches = BranchRunner(engine, worker or WorkerConfig(), "in-process")
    config = WorkflowConfig(colocated=True, default_max_tokens=sessions.config.default_max_tokens,
                            worker_header=branches.config.header, limits=sessions.config.limits)
    workflows = WorkflowDriver(ThreadRoles(branches.run, synth.run, synth.info), directory, config, engine.tokenize,
                               chat_renderer(engine.lm.tokenizer, engine.config.model_path))
    workflows.recorder = TraceRecorder(record_dir, "in-process") if record_dir else None
    server, bound = start_server(SessionAPI(sessions), workflows, host, port, grpc_threads, keys, tls)
    return InProcessServer(server, bound, sessions, receiver, workflows.recorder)
