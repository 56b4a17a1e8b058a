"""The Worker deployment: hosts a BranchRunner on its own engine (one GPU when there is one)."""

from ray import serve

from braid.api.messages import BranchRequest
from braid.engine import Engine, EngineConfig
from braid.workers.runner import BranchRunner, WorkerConfig


@serve.deployment(name="Worker")
class Worker:
    def __init__(self, engine_config: EngineConfig, config: WorkerConfig):
        replica = serve.get_replica_context().replica_id.unique_id
        self.runner = BranchRunner(Engine(engine_config), config, name=f"worker-{replica}")

    def run_branches(self, req: BranchRequest):
        """Streams BranchToken per token, then BranchDone per branch (braid.api.messages)."""
        yield from self.runner.run(req)
