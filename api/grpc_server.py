"""Serving the agent API over a plain gRPC server (in one process; Ray Serve's proxy is the other), and the
mapping of every error to a gRPC status."""

import functools
import logging
from concurrent import futures

import grpc
import redis

from braid.api.auth import ApiKeys
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


def _caller(keys: ApiKeys | None, context) -> str:
    """The calling key's name ("" on an open API); KeyCheck has refused a call without a valid one already."""
    return keys.check(context.invocation_metadata()) if keys is not None else ""


def _unary(fn, keys: ApiKeys | None):
    @functools.wraps(fn)
    def handler(request, context):
        try:
            return fn(request, _caller(keys, context))
        except Exception as e:  # noqa: BLE001 - every failure becomes a status
            context.abort(*grpc_status(e))

    return handler


def _streaming(fn, keys: ApiKeys | None):
    @functools.wraps(fn)
    def handler(request, context):
        try:
            yield from fn(request, _caller(keys, context))
        except Exception as e:  # noqa: BLE001
            context.abort(*grpc_status(e))

    return handler


STREAMING = {m.name for m in agent_pb2.DESCRIPTOR.services_by_name["AgentService"].methods if m.server_streaming}


def make_servicer(logic: AgentLogic, workflows: WorkflowDriver,
                  keys: ApiKeys | None = None) -> agent_pb2_grpc.AgentServiceServicer:
    servicer = agent_pb2_grpc.AgentServiceServicer()
    for method in agent_pb2.DESCRIPTOR.services_by_name["AgentService"].methods:
        if method.name == "RunWorkflow":
            fn = lambda request, caller: iterate_blocking(workflows.run(request, caller))  # noqa: E731
        else:
            fn = getattr(logic, method.name)
        setattr(servicer, method.name, (_streaming if method.name in STREAMING else _unary)(fn, keys))
    return servicer


class KeyCheck(grpc.ServerInterceptor):
    """Refuses every RPC without a valid API key (UNAUTHENTICATED) before its handler runs."""

    def __init__(self, keys: ApiKeys):
        self.keys = keys

    def intercept_service(self, continuation, handler_call_details):
        try:
            self.keys.check(handler_call_details.invocation_metadata)
        except BraidError as e:
            handler = continuation(handler_call_details)
            if handler is None:
                return None
            code, details = grpc_status(e)

            def deny(request, context):
                context.abort(code, details)

            wrap = grpc.unary_stream_rpc_method_handler if handler.response_streaming else \
                grpc.unary_unary_rpc_method_handler
            return wrap(deny, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
        return continuation(handler_call_details)


def start_server(logic: AgentLogic, workflows: WorkflowDriver, host: str = "127.0.0.1", port: int = 0,
                 workers: int = 8, keys: ApiKeys | None = None, tls: tuple[str, str] | None = None):
    """Start a gRPC server for the agent API; returns (server, bound port). `keys`: API keys every RPC
    must carry (None: open); `tls`: (certificate chain, private key) PEM files to serve TLS with."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                         interceptors=[KeyCheck(keys)] if keys is not None else [])
    agent_pb2_grpc.add_AgentServiceServicer_to_server(make_servicer(logic, workflows, keys), server)
    if tls is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        chain, key = (open(path, "rb").read() for path in tls)
        bound = server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([(key, chain)]))
    server.start()
    log.info("agent API on %s:%d", host, bound)
    return server, bound
