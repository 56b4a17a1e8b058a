"""The Worker deployment: hosts a BranchRunner on its own engine (one GPU when there is one)."""

from ray import serve

from braid.engine import Engine, EngineConfig
from braid.engine.threads import serving_thread
from braid.runtime.aio import in_thread
from braid.runtime.messages import BranchRequest, NodesRequest
from braid.runtime.metrics import report_engine
from braid.workers.runner import BranchRunner, WorkerConfig


@serve.deployment(name="Worker")
class Worker:
    def __init__(self, engine_config: EngineConfig, config: WorkerConfig):
        replica = serve.get_replica_context().replica_id.unique_id
        self.runner = BranchRunner(Engine(engine_config), config, name=f"worker-{replica}")
        serving_thread(self.runner.engine.lm.device)  # (this thread serves requests: engine.threads)
        report_engine(self.runner.engine)

    async def run_branches(self, req: BranchRequest):
        """Streams BranchToken per token, then BranchDone per branch (braid.runtime.messages). Async, so the
        replica takes many calls at once; each runs on its own thread into the engine's scheduler."""
        async for item in in_thread(lambda: self.runner.run(req)):
            yield item

    async def run_nodes(self, req: NodesRequest):
        """A RunGraph wave's calls for the Synthesizer replica running the graph (BranchRunner.run_nodes)."""
        async for item in in_thread(lambda: self.runner.run_nodes(req)):
            yield item

    def load(self) -> dict[str, int]:
        """The engine scheduler's calls waiting and running, and its work KV bytes (an operator's probe)."""
        return self.runner.engine.scheduler.load
