"""Serve wiring: the AgentIngress, Worker and Synthesizer deployments bound into one application."""

import torch

from braid.api.ingress import AgentIngress
from braid.cluster.config import Autoscaling, ClusterConfig
from braid.synthesizer.deployment import Synthesizer
from braid.workers.deployment import Worker

SERVICER = "braid.cluster.grpc_proxy.add_agent_service"  # (Serve's proxy registers the agent service with it)
APP = "braid"  # the Serve application: clients send it as gRPC metadata `application`


def deployment_options(replicas: int, autoscaling: Autoscaling | None, gpus: float | None,
                       resources: dict[str, float], ongoing: int) -> dict:
    """Serve options of one role's deployment: a GPU each when GPUs exist (unless set), a fixed replica count
    or autoscaling, and the custom resources that pin it to a node group."""
    if gpus is None:
        gpus = 1 if torch.cuda.is_available() else 0
    options = {"max_ongoing_requests": ongoing,
               "ray_actor_options": {"num_gpus": gpus, "num_cpus": 0, "resources": dict(resources)}}
    if autoscaling is None:
        options["num_replicas"] = replicas
    else:
        options["autoscaling_config"] = {"min_replicas": autoscaling.min_replicas,
                                         "max_replicas": autoscaling.max_replicas,
                                         "target_ongoing_requests": autoscaling.target_ongoing_requests}
    return options


def build_app(config: ClusterConfig, redis_url: str):
    """The Serve application. Colocated, there are no Worker replicas: the synthesizer's replicas run the
    branches too (transport "local")."""
    # Each replica's scheduler batches the calls it holds. Colocated, a workflow holds a synthesis call
    # (waiting for its branches) and a branch call on the same deployment: twice the room.
    ongoing = config.max_ongoing_requests * (2 if config.colocate else 1)
    workers = None
    if not config.colocate:
        workers = Worker.options(**deployment_options(
            config.worker_replicas, config.worker_autoscaling, config.gpus_per_worker, config.worker_resources,
            config.max_ongoing_requests)).bind(config.engine_config("worker"), config.worker_config())
    synth = Synthesizer.options(**deployment_options(
        config.synthesizer_replicas, config.synthesizer_autoscaling, config.gpus_per_synthesizer,
        config.synthesizer_resources, ongoing)).bind(
        config.engine_config("synthesizer"), config.synthesizer_config(), config.service_config(), redis_url,
        config.session_ttl_s, config.worker_config() if config.colocate else None,
        workers if config.synthesizer_config().graph_worker_calls else None)
    return AgentIngress.bind(workers or synth, synth, config.workflow_config(), redis_url, config.session_ttl_s,
                             config.model_path, config.api_keys_file)
