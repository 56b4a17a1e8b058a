"""The agent service as Serve's proxy registers it: a client that leaves mid-stream, at any point, cancels the
proxy's wait for the replica (where the proxy cancels the replica's work)."""

import asyncio
import enum
from concurrent import futures
from unittest.mock import Mock

import grpc
import pytest

from braid.cluster.grpc_proxy import add_agent_service, decoupled
from braid.protos import agent_pb2 as pb
from braid.protos import agent_pb2_grpc


class Replica:
    """A proxy handler's stand-in: yields `n` messages, each after waiting for the replica's next one; records
    whether that wait was cancelled (what makes Serve's proxy cancel the replica's work)."""

    def __init__(self, n: int, fail_after: int | None = None):
        self.n, self.fail_after, self.cancelled, self.finished = n, fail_after, False, False

    async def __call__(self, request, context):
        try:
            for i in range(self.n):
                await asyncio.sleep(0.001)  # (the wait for the replica's next message)
                if i == self.fail_after:
                    raise RuntimeError("replica failed")
                yield f"{request}:{i}"
            self.finished = True
        except asyncio.CancelledError:
            self.cancelled = True
            raise


class Context:
    """A servicer context's writing side: records what was written; `fail_on` makes that write fail (the client
    has gone)."""

    def __init__(self, fail_on: int | None = None):
        self.written, self.fail_on = [], fail_on

    async def write(self, message):
        if len(self.written) == self.fail_on:
            raise ConnectionError("the client has gone")
        self.written.append(message)


def test_every_message_is_written_in_order_and_errors_are_raised():
    async def main():
        replica, context = Replica(5), Context()
        await decoupled(replica)("r", context)
        assert context.written == [f"r:{i}" for i in range(5)] and replica.finished and not replica.cancelled
        with pytest.raises(RuntimeError, match="replica failed"):
            await decoupled(Replica(5, fail_after=2))("r", Context())

    asyncio.run(main())


@pytest.mark.parametrize("how", ["a-write-fails", "cancelled-while-waiting"])
def test_a_client_that_leaves_cancels_the_wait_for_the_replica(how):
    """A write that fails (the client left as a message went out: the case Serve's own handler misses), or the
    handler cancelled while it waits for the next message: either way the replica wait is cancelled, and the
    handler returns only once the proxy's side has finished."""
    async def main():
        replica = Replica(10_000)
        if how == "a-write-fails":
            with pytest.raises(ConnectionError):
                await decoupled(replica)("r", Context(fail_on=1))
        else:
            handler = asyncio.create_task(decoupled(replica)("r", Context()))
            await asyncio.sleep(0.05)
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        assert replica.cancelled and not replica.finished

    asyncio.run(main())


def test_registration_decouples_only_the_proxys_streaming_handlers():
    """With Serve's handler factory on the server, the unary-stream handlers it makes are wrapped (and the factory
    is restored); the unary ones are Serve's own."""
    made = []

    class ServeLikeServer:
        def __init__(self):
            self.service_handler_factory = self.factory
            self.handlers = None

        def factory(self, service_method, streaming_type):
            async def handler(request, context):
                yield service_method
            made.append((service_method, streaming_type))
            return handler

        def add_generic_rpc_handlers(self, handlers):  # (what gRPCGenericServer overrides)
            self.handlers = {m: self.service_handler_factory(service_method=m, streaming_type=t)
                             for m, t in (("/braid.v1.AgentService/RunWorkflow", _Type.UNARY_STREAM),
                                          ("/braid.v1.AgentService/Prefill", _Type.UNARY_UNARY))}

        def add_registered_method_handlers(self, name, handlers):
            pass

    server = ServeLikeServer()
    original = server.service_handler_factory
    add_agent_service(Mock(), server)  # (Serve passes a Mock servicer too)
    assert server.service_handler_factory == original and len(made) == 2
    assert server.handlers["/braid.v1.AgentService/RunWorkflow"].__qualname__.startswith("decoupled.")
    assert server.handlers["/braid.v1.AgentService/Prefill"].__name__ == "handler"


def test_a_plain_server_gets_the_generated_registration():
    """A gRPC server without Serve's handler factory (the in-process server's kind) gets the service as the
    generated code registers it: its servicer's own methods answer, unary and streaming, as plain sync handlers
    (a decoupled handler is a coroutine, which a sync server could not run)."""

    class Servicer(agent_pb2_grpc.AgentServiceServicer):
        def Health(self, request, context):
            return pb.HealthResponse(status="SERVING", model_fingerprint="plain")

        def Generate(self, request, context):
            for i, word in enumerate(request.prompt.split()):
                yield pb.TokenEvent(token_id=i, text=word)

    plain = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_agent_service(Servicer(), plain)
    assert not hasattr(plain, "service_handler_factory")  # (nothing of Serve's left on it)
    port = plain.add_insecure_port("127.0.0.1:0")
    plain.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            assert stub.Health(pb.HealthRequest(), timeout=10).model_fingerprint == "plain"
            events = list(stub.Generate(pb.GenerateRequest(prompt="one two three"), timeout=10))
            assert [(e.token_id, e.text) for e in events] == [(0, "one"), (1, "two"), (2, "three")]
            with pytest.raises(grpc.RpcError) as err:  # (a method it does not implement: the generated default)
                stub.ListSessions(pb.ListSessionsRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        plain.stop(0)


class _Type(str, enum.Enum):  # (Serve's gRPCStreamingType, as far as the factory's callers use it)
    UNARY_UNARY = "unary_unary"
    UNARY_STREAM = "unary_stream"
