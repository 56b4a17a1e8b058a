"""Serving the agent API over a plain gRPC server (in one process; Ray Serve's proxy is the other), and the
mapping of every error to a gRPC status."""

import functools
import logging
from concurrent import futures

import grpc
import redis

from braid.api.service import AgentLogic
from braid.api.workflow import WorkflowDriver, iterate_blocking
from braid.engine.errors import BraidError
from braid.protos import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)


def grpc_status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and message a client gets for an exception raised while serving."""
    if isinstance(exc, BraidError):
        return grpc.StatusCode[exc.code], str(exc)
    if isinstance(exc, redis.RedisError):
        return grpc.StatusCode.UNAVAILABLE, f"control plane (Redis) unavailable: {exc}"
    log.exception("internal error")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _unary(fn):
    @functools.wraps(fn)
    def handler(request, context):
        try:
            return fn(request)
        except Exception as e:  # noqa: BLE001 - every failure becomes a status
            context.abort(*grpc_status(e))

    return handler


def _streaming(fn):
    @functools.wraps(fn)
    def handler(request, context):
        try:
            yield from fn(request)
        except Exception as e:  # noqa: BLE001
            context.abort(*grpc_status(e))

    return handler


STREAMING = {m.name for m in agent_pb2.DESCRIPTOR.services_by_name["AgentService"].methods if m.server_streaming}


def make_servicer(logic: AgentLogic, workflows: WorkflowDriver) -> agent_pb2_grpc.AgentServiceServicer:
    servicer = agent_pb2_grpc.AgentServiceServicer()
    for method in agent_pb2.DESCRIPTOR.services_by_name["AgentService"].methods:
        if method.name == "RunWorkflow":
            fn = lambda request: iterate_blocking(workflows.run(request))  # noqa: E731
        else:
            fn = getattr(logic, method.name)
        setattr(servicer, method.name, (_streaming if method.name in STREAMING else _unary)(fn))
    return servicer


def start_server(logic: AgentLogic, workflows: WorkflowDriver, host: str = "127.0.0.1", port: int = 0,
                 workers: int = 8):
    """Start a gRPC server for the agent API; returns (server, bound port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    agent_pb2_grpc.add_AgentServiceServicer_to_server(make_servicer(logic, workflows), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    log.info("agent API on %s:%d", host, bound)
    return server, bound
