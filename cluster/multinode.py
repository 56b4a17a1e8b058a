"""A Ray cluster of several nodes on one machine (Ray's cluster utilities: one raylet per node, on loopback), a
deploy config sent to it with `serve deploy`, and where Serve placed each deployment's replicas. Everything after
the start goes through the dashboard's HTTP API, as it would from outside a Kubernetes cluster."""

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import requests
from ray.cluster_utils import Cluster

from braid.kv.peer_auth import ensure_cluster_token

log = logging.getLogger(__name__)


@dataclass
class NodeGroup:
    """One node: its name (a node group in Kubernetes terms), CPUs and custom resources."""
    name: str
    num_cpus: int = 0
    resources: dict[str, float] = field(default_factory=dict)


@dataclass
class MultiNode:
    cluster: Cluster
    dashboard_url: str
    nodes: dict[str, str]  # Ray node id -> group name

    @property
    def ip(self) -> str:
        """Where the nodes listen (the head's proxies among them)."""
        return self.cluster.head_node.node_ip_address

    def shutdown(self) -> None:
        self.cluster.shutdown()


def start_multinode(head: NodeGroup, others: list[NodeGroup], dashboard_port: int,
                    temp_dir: str | None = None) -> MultiNode:
    """A head node (with the dashboard, which `serve deploy` talks to) and one node per other group, all on
    this machine's address (Ray turns a loopback address into it when processes connect)."""
    ensure_cluster_token()  # (before the nodes start: their replicas inherit it)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head.num_cpus, "resources": head.resources, "include_dashboard": True,
        "dashboard_host": "127.0.0.1", "dashboard_port": dashboard_port,
        **({"temp_dir": temp_dir} if temp_dir else {})})
    names = {cluster.head_node.node_id: head.name}
    for group in others:
        node = cluster.add_node(num_cpus=group.num_cpus, resources=group.resources)
        names[node.node_id] = group.name
    cluster.wait_for_nodes()
    return MultiNode(cluster, f"http://127.0.0.1:{dashboard_port}", names)


def serve_deploy(config_path: str, dashboard_url: str, app: str = "braid", timeout_s: float = 300) -> None:
    """`serve deploy` (Serve's own CLI, through the dashboard's REST API), then wait until the app runs."""
    cli = os.path.join(os.path.dirname(sys.executable), "serve")
    done = subprocess.run([cli, "deploy", config_path, "--address", dashboard_url], capture_output=True, text=True,
                          timeout=120)
    if done.returncode:
        raise RuntimeError(f"serve deploy failed: {done.stderr.strip() or done.stdout.strip()}")
    deadline, status = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        apps = requests.get(f"{dashboard_url}/api/serve/applications/", timeout=10).json().get("applications", {})
        status = apps.get(app) or {}
        if status.get("status") == "RUNNING":
            return
        if status.get("status") == "DEPLOY_FAILED":
            raise RuntimeError(f"serve deploy of {app!r} failed: {status.get('message')}")
        time.sleep(1)
    raise TimeoutError(f"{app!r} not running after {timeout_s:.0f}s: {status.get('status')} {status.get('message')}")


def placement(multi: MultiNode, app: str = "braid") -> dict[str, list[str]]:
    """Each deployment of `app` -> the node groups its live replicas run on (Ray's state API, over HTTP)."""
    from ray.util.state import list_actors

    nodes, out = multi.nodes, {}
    for actor in list_actors(address=multi.dashboard_url, filters=[("state", "=", "ALIVE")], limit=10_000):
        prefix = f"ServeReplica:{app}:"
        if actor.class_name.startswith(prefix):
            out.setdefault(actor.class_name.removeprefix(prefix), []).append(nodes.get(actor.node_id, actor.node_id))
    return {name: sorted(groups) for name, groups in sorted(out.items())}
