"""Serve's deploy config for a cluster config: what `serve deploy` and KubeRay's RayService (`serveConfigV2`) run."""

from braid.cluster.app import APP, SERVICER, build_app
from braid.cluster.config import ClusterConfig
from braid.engine.config import paths_elsewhere

BUILDER = "braid.cluster.deploy:app_builder"
HTTP_PORT = 8000  # Serve's HTTP proxy (its health routes; the agent API is gRPC)


def deployed_config(values: dict) -> ClusterConfig:
    """Cluster config `values` validated as the replicas will take them, except for the files they name (those
    are on the cluster's machines, not on the one that builds the config)."""
    config = ClusterConfig.from_dict(values, local_paths=False)
    if not config.redis_url:
        raise ValueError("a deployed cluster needs redis_url: its replicas may run on any node, so the embedded "
                         "Redis of `braid serve` cannot serve them")
    return config


def app_builder(args: dict):
    """Serve's application builder: `args` is {"config": cluster config values}. It may run on any node (Serve
    builds apps in a task), so the model and key files are looked for by the replicas that load them."""
    if set(args) != {"config"}:
        raise ValueError(f"the braid application takes one argument, 'config' (cluster config values); got "
                         f"{sorted(args)}")
    config = deployed_config(args["config"])
    with paths_elsewhere():
        return build_app(config, config.redis_url)


def serve_config(values: dict) -> dict:
    """The deploy config (Ray Serve's ServeDeploySchema) for cluster config `values` (fields left out take
    ClusterConfig's defaults): proxies on every node, the agent API's gRPC servicer on its grpc_port, and the
    braid application, built from the values by app_builder."""
    config = deployed_config(values)
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": HTTP_PORT},
        "grpc_options": {"port": config.grpc_port, "grpc_servicer_functions": [SERVICER]},
        "applications": [{"name": APP, "route_prefix": f"/{APP}", "import_path": BUILDER,
                          "args": {"config": dict(values)}}],
    }
