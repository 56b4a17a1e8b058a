"""Where a local cluster's agent API listens: Serve's gRPC proxy binds every interface ([::]) and has no option to
bind fewer, so `braid serve --host` reaches into the proxy's process (a Ray worker-process setup hook) and binds
the host asked for instead.

Model math and deployments never import this: only the local cluster's start (cluster/local.py) names it.
"""

import ipaddress
import os

ENV_HOST = "BRAID_GRPC_HOST"  # set by start_local_cluster in the job's runtime env: the host the proxy binds
EVERY_INTERFACE = ("0.0.0.0", "::", "[::]")  # hosts that keep Serve's own bind: every interface, IPv4 and IPv6


def check_host(host: str) -> str:
    """`host` as the gRPC proxy will bind it; a value that is not an IP address or `localhost` is a ValueError
    naming it (a hostname would bind whatever it resolves to, which a user rarely means)."""
    bare = host.strip("[]")
    if bare == "localhost":
        return "127.0.0.1"
    try:
        ipaddress.ip_address(bare)
    except ValueError:
        raise ValueError(f"--host must be an IP address (127.0.0.1, ::1, an interface's address, or 0.0.0.0 for "
                         f"every interface), got {host!r}") from None
    return bare


def every_interface(host: str) -> bool:
    return host in EVERY_INTERFACE


def reach(host: str) -> str:
    """Who can reach an API that listens on `host`, in words."""
    if every_interface(host):
        return "every interface"
    return "this machine only" if ipaddress.ip_address(host).is_loopback else f"{host} only"


def bind_address(host: str, port: int) -> str:
    """The gRPC address for `host` and `port` ([::]:port for every interface; IPv6 hosts bracketed)."""
    if every_interface(host):
        return f"[::]:{port}"
    return f"[{host}]:{port}" if ipaddress.ip_address(host).version == 6 else f"{host}:{port}"


def bind_agent_api_host() -> None:
    """Ray's worker_process_setup_hook for a local cluster's processes: in the one that runs Serve's gRPC proxy,
    its listening address is made `$BRAID_GRPC_HOST`'s (a no-op in every other process, and where the variable
    is unset or names every interface)."""
    host = os.environ.get(ENV_HOST, "")
    if not host or every_interface(host):
        return
    from ray.serve._private import default_impl

    if getattr(default_impl.add_grpc_address, "braid_host", None) == host:
        return

    def add_grpc_address(server, address: str) -> None:
        server.add_insecure_port(bind_address(host, int(address.rpartition(":")[2])))

    add_grpc_address.braid_host = host
    default_impl.add_grpc_address = add_grpc_address
