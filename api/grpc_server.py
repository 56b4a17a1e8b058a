"""Serving the agent API over a plain gRPC server (in one process; Ray Serve's proxy is the other), and the
mapping of every error to a gRPC status.

The server is grpc.aio's, on an event loop of its own thread: a workflow's events go from the engine's
role threads to that loop and out, with no server thread per call between them. Every handler thread a
message crosses takes Python's lock, and the scheduler's thread, which gives it up at every tensor op, waits
for each of them; a thread-pool server (a handler thread per call driving its own loop per message, and a
completion-queue thread) slowed a step of 16 concurrent workflows by more than the handlers' own work
(benchmarks/serving.py). The session-level methods, which block on the engine, run on a thread of their
own per call, as a Serve replica runs them (braid.api.workflow.in_thread).
"""

import asyncio
import functools
import logging
import threading
from contextlib import aclosing

import grpc
import redis

from braid.api.auth import ApiKeys
from braid.api.sessions import SessionAPI
from braid.api.workflow import WorkflowDriver, cause, replica_lost
from braid.engine.errors import BraidError
from braid.protos import agent_pb2, agent_pb2_grpc
from braid.runtime.aio import in_thread, run_in_thread

log = logging.getLogger(__name__)


def grpc_status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and message a client gets for an exception raised while serving."""
    if isinstance(exc, BraidError):
        return grpc.StatusCode[exc.code], str(exc)
    if isinstance(exc, redis.RedisError):
        return grpc.StatusCode.UNAVAILABLE, f"control plane (Redis) unavailable: {exc}"
    if replica_lost(exc):
        return grpc.StatusCode.UNAVAILABLE, (f"the replica serving this call was lost mid-call (killed, crashed or "
                                             f"replaced: {type(cause(exc)).__name__}); retry it")
    log.exception("internal error")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _caller(keys: ApiKeys | None, context) -> str:
    """The calling key's name ("" on an open API); KeyCheck has refused a call without a valid one already."""
    return keys.check(context.invocation_metadata()) if keys is not None else ""


def _unary(fn, keys: ApiKeys | None, slots: asyncio.Semaphore):
    """A session-level call, on a thread of its own. It holds its slot until that thread is done, also when its
    client leaves first (a call blocked in the engine runs to its end), so `slots` bounds the threads too."""
    @functools.wraps(fn)
    async def handler(request, context):
        await slots.acquire()
        try:
            caller = _caller(keys, context)
        except Exception as e:  # noqa: BLE001
            slots.release()
            await context.abort(*grpc_status(e))
        call = asyncio.ensure_future(run_in_thread(lambda: fn(request, caller)))
        call.add_done_callback(_release(slots))
        try:
            return await asyncio.shield(call)
        except Exception as e:  # noqa: BLE001 - every failure becomes a status
            await context.abort(*grpc_status(e))

    return handler


def _release(slots: asyncio.Semaphore):
    def done(call: asyncio.Future) -> None:
        slots.release()
        if not call.cancelled():
            call.exception()  # (retrieved: a client that left does not hear it, and asyncio need not report it)
    return done


def _streaming(fn, keys: ApiKeys | None, slots: asyncio.Semaphore):
    """A streaming method: `fn(request, caller)` gives an async iterator of its messages."""
    @functools.wraps(fn)
    async def handler(request, context):
        async with slots:
            try:
                # (aclosing: a client that leaves closes the stream now, which ends its engine calls)
                async with aclosing(fn(request, _caller(keys, context))) as messages:
                    async for message in messages:
                        yield message
            except Exception as e:  # noqa: BLE001
                await context.abort(*grpc_status(e))

    return handler


STREAMING = {m.name for m in agent_pb2.DESCRIPTOR.services_by_name["AgentService"].methods if m.server_streaming}


def make_servicer(sessions: SessionAPI, workflows: WorkflowDriver, keys: ApiKeys | None,
                  slots: asyncio.Semaphore) -> agent_pb2_grpc.AgentServiceServicer:
    """`slots`: RPCs served at once (more wait for one to end)."""
    servicer = agent_pb2_grpc.AgentServiceServicer()
    for method in agent_pb2.DESCRIPTOR.services_by_name["AgentService"].methods:
        if method.name == "RunWorkflow":
            fn = workflows.run
        elif method.name == "RunGraph":  # (recorded where the cluster records what it serves)
            fn = functools.partial(_recorded_graph, sessions, workflows)
        elif method.name in STREAMING:  # (a blocking generator: on a thread of its own)
            fn = functools.partial(_blocking_stream, getattr(sessions, method.name))
        else:
            fn = getattr(sessions, method.name)
        setattr(servicer, method.name, (_streaming if method.name in STREAMING else _unary)(fn, keys, slots))
    return servicer


def _blocking_stream(fn, request, caller: str):
    return in_thread(lambda: fn(request, caller))


def _recorded_graph(sessions: SessionAPI, workflows: WorkflowDriver, request, caller: str):
    return workflows.record_graph(request, _blocking_stream(sessions.RunGraph, request, caller))


class KeyCheck(grpc.aio.ServerInterceptor):
    """Refuses every RPC without a valid API key (UNAUTHENTICATED) before its handler runs."""

    def __init__(self, keys: ApiKeys):
        self.keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        try:
            self.keys.check(handler_call_details.invocation_metadata)
        except BraidError as e:
            handler = await continuation(handler_call_details)
            if handler is None:
                return None
            code, details = grpc_status(e)

            async def deny(request, context):
                await context.abort(code, details)

            wrap = grpc.unary_stream_rpc_method_handler if handler.response_streaming else \
                grpc.unary_unary_rpc_method_handler
            return wrap(deny, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
        return await continuation(handler_call_details)


class AgentServer:
    """A running agent API server: grpc.aio's server on its own event loop thread. `stop` from any other thread."""

    def __init__(self, server: grpc.aio.Server, loop: asyncio.AbstractEventLoop, thread: threading.Thread):
        self._server, self._loop, self._thread = server, loop, thread
        self._lock, self._stopped = threading.Lock(), False

    def stop(self, grace: float | None = None) -> None:
        """Stop serving (RPCs still running get `grace` seconds, then are cancelled), let every cancelled
        handler finish its cleanup (a workflow closes the session it opened), then end the loop. From any
        thread but the loop's; once (later calls return at once)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("AgentServer.stop() was called from the server's own event loop thread")
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            try:
                asyncio.run_coroutine_threadsafe(_shutdown(self._server, grace), self._loop).result()
            finally:
                _end_loop(self._loop, self._thread)


def _end_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """Stop the loop that `thread` runs, wait for the thread, close the loop."""
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


async def _shutdown(server: grpc.aio.Server, grace: float | None) -> None:
    await server.stop(grace)
    rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
    loop = asyncio.get_running_loop()
    await loop.shutdown_asyncgens()
    await loop.shutdown_default_executor()


def start_server(sessions: SessionAPI, workflows: WorkflowDriver, host: str = "127.0.0.1", port: int = 0,
                 workers: int = 8, keys: ApiKeys | None = None,
                 tls: tuple[str, str] | None = None) -> tuple[AgentServer, int]:
    """Start a gRPC server for the agent API; returns (server, bound port). `workers`: RPCs served at once
    (each streaming RPC holds one while it runs; more wait); `keys`: API keys every RPC must carry (None:
    open); `tls`: (certificate chain, private key) PEM files to serve TLS with."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="braid-grpc", daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(interceptors=[KeyCheck(keys)] if keys is not None else [])
        try:
            servicer = make_servicer(sessions, workflows, keys, asyncio.Semaphore(workers))
            agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server)
            if tls is None:
                bound = server.add_insecure_port(f"{host}:{port}")
            else:
                chain, key = (open(path, "rb").read() for path in tls)
                bound = server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([(key, chain)]))
            await server.start()
        except BaseException:
            await server.stop(None)
            raise
        return server, bound

    try:
        server, bound = asyncio.run_coroutine_threadsafe(start(), loop).result()
    except BaseException:
        _end_loop(loop, thread)
        raise
    log.info("agent API on %s:%d", host, bound)
    return AgentServer(server, loop, thread), bound
