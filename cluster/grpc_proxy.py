"""The agent service as Serve's gRPC proxy registers it, with every client cancel reaching the replicas.

Serve's proxy (Ray 2.60) cancels a streaming call's replica work when the proxy's handler is cancelled while
it waits for the replica's next message. A client that leaves while the proxy is writing a message to it
(the moment after a token went out, when clients usually leave) cancels the write instead; the proxy's
generator is then closed without cancelling the replica, which decodes on to `max_tokens`
(ray-project/ray#42665 describes the race; it was not merged). Measured with `python -m braid.loadtest.chaos
client-leaves`: 8 of 20 cancels left the workflow running.

`add_agent_service` (the servicer function Braid gives Serve: `grpc_servicer_functions`) registers the
service as the generated code does, but runs each streaming handler of the proxy in a task of its own that
only waits on the replica and queues what it gets; the handler gRPC calls reads that queue and writes each
message itself (`context.write`). A client that leaves cancels that handler or fails its write; either way
it cancels the task, which is then always inside the proxy's wait for the replica, where the proxy cancels
the replica's work, and waits for it, so nothing of the proxy's touches the call after gRPC has let it go.

The price of the queue: the proxy's generator ends, and Serve counts the call as done (its ongoing-request
count, latency and access log), once the replica has finished, while the handler may still be writing to a
slow client; and such a client's messages wait in the proxy's memory, not in gRPC's flow control. A bounded
queue would bring the race back (the task would be cancelled while it waits on the queue). Serve's
replicas' own gRPC servers, when Serve runs them, build handlers with the same factory and get the same
wrapping.

Runs inside Serve's proxy actor: it imports only grpc, asyncio and the generated code.
"""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from braid.protos import agent_pb2_grpc

_END = object()


def decoupled(handler: Callable[..., AsyncIterator]) -> Callable[..., Awaitable[None]]:
    """A unary-stream handler that runs `handler` (an async generator of messages) in a task of its own and
    writes what it produces (`context.write`). Leaving it, by cancellation or a write that failed, cancels
    that task and waits for it, so the proxy's code is done with the call before gRPC lets the call go."""

    async def unary_stream(request, context) -> None:
        queue: asyncio.Queue = asyncio.Queue()  # (unbounded: the producer never waits on the client)

        async def produce():
            try:
                async for message in handler(request, context):
                    queue.put_nowait(message)
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001 - handed to the writer
                queue.put_nowait(e)
            finally:
                queue.put_nowait(_END)

        task = asyncio.create_task(produce())
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                await context.write(item)
        finally:
            task.cancel()  # (inside the proxy's wait for the replica: the proxy cancels the replica's work)
            while not task.done():  # (until it has ended, whatever else cancels this handler meanwhile)
                try:
                    await asyncio.wait({task})
                except asyncio.CancelledError:
                    pass

    return unary_stream


def add_agent_service(servicer, server) -> None:
    """Serve's servicer function for the agent service: the generated registration, with the proxy's
    unary-stream handlers decoupled from the writes (module docstring). A server without Serve's handler
    factory (any other gRPC server) gets the generated registration unchanged."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None:
        agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server)
        return

    def braid_factory(service_method: str, streaming_type):
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        return decoupled(handler) if getattr(streaming_type, "name", "") == "UNARY_STREAM" else handler

    server.service_handler_factory = braid_factory
    try:
        agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server)
    finally:
        server.service_handler_factory = factory
