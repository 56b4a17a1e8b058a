"""Starting the cluster on a local Ray: `braid serve`, the tests and the benchmarks share this."""

import logging
import random
import socket
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import gRPCOptions

from braid.cluster.app import APP, SERVICER, build_app
from braid.cluster.config import ClusterConfig
from braid.cluster.listen import ENV_HOST, bind_address, check_host, every_interface
from braid.kv.peer_auth import ensure_cluster_token
from braid.runtime.directory import EmbeddedRedis

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port free now on every interface, for local clusters, tests and benchmarks: below the range the kernel
    hands out to other sockets (ip_local_port_range), so that no connection opened before the port is taken (Ray
    opens many while it starts) is given it meanwhile, as one from that range can be."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    for _ in range(100):
        port = random.randrange(10000, max(10001, ephemeral))
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (none free below the range: any the kernel gives)
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


@dataclass
class LocalCluster:
    config: ClusterConfig
    redis_url: str
    redis_server: EmbeddedRedis | None
    host: str = "127.0.0.1"  # where the agent API listens (cluster.listen: 0.0.0.0 or :: for every interface)
    dashboard_url: str | None = None  # the Ray dashboard, when started
    metrics_url: str | None = None  # this node's Prometheus export (Serve metrics are prefixed ray_)

    @property
    def address(self) -> str:
        """How this machine reaches the agent API."""
        host = "127.0.0.1" if every_interface(self.host) else self.host
        return bind_address(host, self.config.grpc_port)

    @property
    def listen_address(self) -> str:
        """Where the agent API listens ([::]:port: every interface, IPv4 and IPv6)."""
        return bind_address(self.host, self.config.grpc_port)

    def stop(self) -> None:
        serve.shutdown()
        ray.shutdown()
        if self.redis_server:
            self.redis_server.stop()


def start_local_cluster(config: ClusterConfig, num_cpus: int | None = None, dashboard: bool = False,
                        metrics_port: int | None = None, temp_dir: str | None = None,
                        host: str = "127.0.0.1") -> LocalCluster:
    """A cluster on a new local Ray whose agent API listens on `host` (default: this machine only; 0.0.0.0 or ::
    for every interface), with an embedded Redis unless the config names one."""
    host = check_host(host)
    redis_server = None if config.redis_url else EmbeddedRedis()
    redis_url = config.redis_url or redis_server.url
    ensure_cluster_token()  # (before Ray starts: its processes, the replicas among them, inherit it)
    for attempt in range(2):  # a start can time out on a loaded 2-core machine: retry once
        try:
            ctx = ray.init(num_cpus=num_cpus, include_dashboard=dashboard, dashboard_host="127.0.0.1",
                           log_to_driver=False, _node_ip_address="127.0.0.1", _temp_dir=temp_dir,
                           _metrics_export_port=metrics_port,
                           # (the process that runs Serve's gRPC proxy binds `host`: cluster.listen)
                           runtime_env={"worker_process_setup_hook": "braid.cluster.listen.bind_agent_api_host",
                                        "env_vars": {ENV_HOST: host}})
            break
        except Exception:  # noqa: BLE001
            ray.shutdown()
            if attempt:
                if redis_server:
                    redis_server.stop()
                raise
    serve.start(grpc_options=gRPCOptions(port=config.grpc_port, grpc_servicer_functions=[SERVICER]),
                http_options={"host": "127.0.0.1"})
    # Serve's proxy routes gRPC by the `application` metadata, but only to apps with a route prefix; its
    # "ready at http://..." line names that HTTP route, which is not the agent API, so it is not shown.
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    serve.run(build_app(config, redis_url), name=APP, route_prefix=f"/{APP}")
    log.info("cluster up: agent API on %s, redis %s", config.grpc_port, redis_url)
    dashboard_url = ctx.dashboard_url and f"http://{ctx.dashboard_url}"
    node = next((n for n in ray.nodes() if n.get("Alive")), {})
    export = node.get("MetricsExportPort") or metrics_port
    return LocalCluster(config, redis_url, redis_server, host, dashboard_url or None,
                        f"http://127.0.0.1:{export}/metrics" if export else None)
