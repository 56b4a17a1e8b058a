"""The Synthesizer deployment: receives branch KV, synthesizes, and hosts the session-level agent API.

Colocated (one engine per replica for both roles), it also runs branches, and they reach its
synthesis by the local transport.
"""

import logging

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from braid.api.sessions import SessionAPI
from braid.engine import EngineConfig
from braid.engine.threads import serving_thread
from braid.kv.receiver import KVReceiver
from braid.methods.calibration import load_engine
from braid.runtime.aio import in_thread, run_in_thread
from braid.runtime.directory import Directory
from braid.runtime.messages import BranchRequest, KVArrived, SynthesisDone, SynthesisRequest
from braid.runtime.metrics import metrics, report_engine
from braid.runtime.sessions import ServiceConfig, Sessions
from braid.synthesizer.runner import SynthesisRunner, SynthesizerConfig
from braid.synthesizer.waves import WaveWorkers, WorkerWaves
from braid.workers.runner import BranchRunner, WorkerConfig

log = logging.getLogger(__name__)
SESSIONS_ROUTED_PER_REPLICA = 4096  # sessions a replica is remembered as holding (LRU); beyond, calls may move


@serve.deployment(name="Synthesizer")
class Synthesizer:
    def __init__(self, engine_config: EngineConfig, config: SynthesizerConfig, service: ServiceConfig,
                 redis_url: str, session_ttl_s: int, colocated_worker: WorkerConfig | None = None,
                 workers: DeploymentHandle | None = None):
        self.engine = load_engine(engine_config)
        serving_thread(self.engine.lm.device)  # (this thread serves requests: engine.threads)
        replica_id = serve.get_replica_context().replica_id
        replica = replica_id.unique_id
        service.pool = f"{replica_id.deployment_id.app_name}/{replica_id.deployment_id.name}"
        receiver = KVReceiver(self.engine.fingerprint, host=ray.util.get_node_ip_address())
        service.replica = replica
        self.sessions = Sessions(self.engine, Directory.connect(redis_url, session_ttl_s), service)
        self.api = SessionAPI(self.sessions)  # (the session RPCs: agent_unary, agent_stream)
        exports = self.sessions.start_upkeep(host=ray.util.get_node_ip_address())  # (a session's messages, to others)
        self.runner = SynthesisRunner(self.engine, receiver, self.sessions, config)
        self.branches = BranchRunner(self.engine, colocated_worker, f"colocated-{replica}") if colocated_worker else None
        if workers is not None and config.graph_worker_calls:  # RunGraph's waves decode on the Worker replicas
            on_workers = WaveWorkers(lambda req: workers.options(stream=True).run_nodes.remote(req),
                                     config.graph_worker_calls, config.graph_transport, service.fetch_timeout_s,
                                     config.kv_wait_timeout_s, config.kv_queue_timeout_s)
            self.sessions.waves = lambda sid: WorkerWaves(self.engine, receiver, exports, on_workers, sid,
                                                          self.sessions.lend)
        self.metrics = metrics()
        # (store bytes, the scheduler's gauges and messages encoded again, every second)
        report_engine(self.engine, recovery=self.sessions.recovery)
        log.info("synthesizer %s: KV in at %s, session messages out at %s, prefill %.0f tok/s", replica,
                 receiver.address, exports, self.runner.prefill_tokens_per_s)

    def __del__(self):
        """Serve's graceful shutdown of this replica (a scale-down, a rolling update): its session messages go to
        live peers, within the service's hand-over budget; then it serves them no more, and its address is
        withdrawn at once, so the replicas that need one it could not hand over encode it again."""
        if hasattr(self, "sessions"):  # (not when __init__ failed before it made one)
            try:
                self.sessions.hand_over()
            finally:
                self.sessions.stop_upkeep()

    def recovery(self) -> dict:
        """This replica's id, and the messages it took over from draining ones and encoded again from their lineages
        (with their tokens and seconds): an operator's probe, as the metrics report them."""
        return {"replica": self.sessions.config.replica, **self.sessions.recovery}

    def info(self):
        return self.runner.info()

    def load(self) -> dict[str, int]:
        """The engine scheduler's calls waiting and running, and its work KV bytes (an operator's probe)."""
        return self.engine.scheduler.load

    # Session affinity: the ingress routes a session's calls with the session id as Serve's multiplexed model
    # id, and a replica that serves a session "loads" it here, so the router sends its later calls here, where
    # its messages are. A call that lands elsewhere anyway moves the messages it names (Sessions.resolve).
    @serve.multiplexed(max_num_models_per_replica=SESSIONS_ROUTED_PER_REPLICA)
    async def _session(self, session_id: str) -> str:
        return session_id

    async def _serving(self, session_id: str) -> None:
        if session_id:
            await self._session(session_id)

    # Async methods: the replica takes many calls at once; each blocking runner call goes to its own thread,
    # and the engine's scheduler batches what they submit.
    async def agent_unary(self, name: str, request, caller: str = ""):
        await self._serving(getattr(request, "session_id", ""))
        response = await run_in_thread(lambda: getattr(self.api, name)(request, caller=caller))
        await self._serving(getattr(response, "session_id", ""))  # (a session this call opened)
        return response

    async def agent_stream(self, name: str, request, caller: str = ""):
        await self._serving(getattr(request, "session_id", ""))
        async for item in in_thread(lambda: getattr(self.api, name)(request, caller=caller)):
            if not request.session_id and hasattr(item, "done") and item.HasField("done"):
                await self._serving(item.done.session_id)  # (a session this call opened)
            yield item

    async def run_branches(self, req: BranchRequest):
        """Colocated only: the worker role on this replica's engine."""
        if self.branches is None:
            raise RuntimeError("run_branches reached a synthesizer that is not colocated")
        async for item in in_thread(lambda: self.branches.run(req)):
            yield item

    async def synthesize(self, req: SynthesisRequest):
        """Streams SynthesisOpened, then KVArrived per copied branch, AnswerToken per token, SynthesisDone."""
        await self._serving(req.session)
        m, tags = self.metrics, {"transport": str(req.transport)}
        async for item in in_thread(lambda: self.runner.run(req)):
            if isinstance(item, KVArrived):
                m["kv_bytes"].inc(item.bytes, tags={"transport": str(item.transport)})
                m["kv_seconds"].observe(item.transfer_ms / 1e3, tags={"transport": str(item.transport)})
            elif isinstance(item, SynthesisDone):
                if item.tpot_s is not None:
                    m["tpot"].observe(item.tpot_s, tags=tags)
                if not item.registered:
                    m["control_plane_errors"].inc()
            yield item
