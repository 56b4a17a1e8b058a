"""Serve wiring: the AgentIngress, Worker and Synthesizer deployments bound into one application."""

import torch

from braid.api.ingress import AgentIngress
from braid.cluster.config import ClusterConfig
from braid.synthesizer.deployment import Synthesizer
from braid.workers.deployment import Worker

SERVICER = "braid.protos.agent_pb2_grpc.add_AgentServiceServicer_to_server"


def build_app(config: ClusterConfig, redis_url: str):
    """The Serve application. Workers and the synthesizer get a GPU each when GPUs exist; colocated,
    there are no Worker replicas: the synthesizer's replicas run the branches too (transport "local")."""
    gpu = 1 if torch.cuda.is_available() else 0
    engine = config.engine_config("synthesizer")
    # Each replica's scheduler batches the calls it holds. Colocated, a workflow holds a synthesis call
    # (waiting for its branches) and a branch call on the same deployment: twice the room.
    ongoing = config.max_ongoing_requests * (2 if config.colocate else 1)
    synth = Synthesizer.options(num_replicas=config.synthesizer_replicas, max_ongoing_requests=ongoing,
                                ray_actor_options={
        "num_gpus": gpu if config.gpus_per_synthesizer is None else config.gpus_per_synthesizer, "num_cpus": 0}).bind(
        engine, config.synthesizer_config(), config.service_config(), redis_url, config.session_ttl_s,
        config.worker_config() if config.colocate else None)
    workers = synth
    if not config.colocate:
        workers = Worker.options(num_replicas=config.worker_replicas, max_ongoing_requests=config.max_ongoing_requests,
                                 ray_actor_options={
            "num_gpus": gpu if config.gpus_per_worker is None else config.gpus_per_worker, "num_cpus": 0}).bind(
            config.engine_config("worker"), config.worker_config())
    return AgentIngress.bind(workers, synth, config.workflow_config(), redis_url, config.session_ttl_s,
                             config.model_path)
