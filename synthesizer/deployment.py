"""The Synthesizer deployment: receives branch KV, synthesizes, and hosts the session-level agent API.

Colocated (one engine per replica for both roles), it also runs branches, and they reach its
synthesis by the local transport.
"""

import logging

import ray
from ray import serve

from braid.api.directory import Directory
from braid.api.messages import BranchRequest, KVArrived, SynthesisDone, SynthesisRequest
from braid.api.metrics import metrics, report_engine
from braid.api.service import AgentLogic, ServiceConfig
from braid.api.workflow import in_thread, run_in_thread
from braid.engine import Engine, EngineConfig
from braid.kv.receiver import KVReceiver
from braid.synthesizer.runner import SynthesisRunner, SynthesizerConfig
from braid.workers.runner import BranchRunner, WorkerConfig

log = logging.getLogger(__name__)


@serve.deployment(name="Synthesizer")
class Synthesizer:
    def __init__(self, engine_config: EngineConfig, config: SynthesizerConfig, service: ServiceConfig,
                 redis_url: str, session_ttl_s: int, colocated_worker: WorkerConfig | None = None):
        self.engine = Engine(engine_config)
        replica = serve.get_replica_context().replica_id.unique_id
        receiver = KVReceiver(self.engine.fingerprint, host=ray.util.get_node_ip_address())
        service.replica = replica
        self.agent = AgentLogic(self.engine, Directory.connect(redis_url, session_ttl_s), service)
        self.runner = SynthesisRunner(self.engine, receiver, self.agent, config)
        self.branches = BranchRunner(self.engine, colocated_worker, f"colocated-{replica}") if colocated_worker else None
        self.metrics = metrics()
        report_engine(self.engine)  # (store bytes and the scheduler's gauges, every second)
        log.info("synthesizer %s: KV at %s, prefill %.0f tok/s", replica, receiver.address,
                 self.runner.prefill_tokens_per_s)

    def info(self):
        return self.runner.info()

    # Async methods: the replica takes many calls at once; each blocking runner call goes to its own thread,
    # and the engine's scheduler batches what they submit.
    async def agent_unary(self, name: str, request, caller: str = ""):
        return await run_in_thread(lambda: getattr(self.agent, name)(request, caller=caller))

    async def agent_stream(self, name: str, request, caller: str = ""):
        async for item in in_thread(lambda: getattr(self.agent, name)(request, caller=caller)):
            yield item

    async def run_branches(self, req: BranchRequest):
        """Colocated only: the worker role on this replica's engine."""
        if self.branches is None:
            raise RuntimeError("run_branches reached a synthesizer that is not colocated")
        async for item in in_thread(lambda: self.branches.run(req)):
            yield item

    async def synthesize(self, req: SynthesisRequest):
        """Streams SynthesisOpened, then KVArrived per copied branch, AnswerToken per token, SynthesisDone."""
        m, tags = self.metrics, {"transport": req.transport}
        async for item in in_thread(lambda: self.runner.run(req)):
            if isinstance(item, KVArrived):
                m["kv_bytes"].inc(item.bytes, tags={"transport": item.transport})
                m["kv_seconds"].observe(item.transfer_ms / 1e3, tags={"transport": item.transport})
            elif isinstance(item, SynthesisDone):
                if item.tpot_s is not None:
                    m["tpot"].observe(item.tpot_s, tags=tags)
                if not item.registered:
                    m["control_plane_errors"].inc()
            yield item
