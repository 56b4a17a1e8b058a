"""The AgentIngress deployment: the agent API behind Serve's gRPC proxy (methods named as the RPCs)."""

import asyncio
import logging

from ray import serve
from ray.serve.handle import DeploymentHandle

from braid.api.auth import ApiKeys, DeadlineError, request_timeout
from braid.api.grpc_server import grpc_status
from braid.api.workflow import WorkflowConfig, WorkflowDriver, cause
from braid.models.chat import chat_renderer
from braid.protos import agent_pb2 as pb
from braid.runtime.directory import Directory
from braid.runtime.messages import BranchRequest, SynthesisRequest, SynthesizerInfo
from braid.runtime.metrics import metrics
from braid.runtime.traces import TraceRecorder

log = logging.getLogger(__name__)


def _fail(context, exc: BaseException):
    """Raise with the status a client should see; Serve's proxy keeps a code set before raising."""
    exc = cause(exc)
    if context is not None and isinstance(exc, Exception):
        code, details = grpc_status(exc)
        context.set_code(code)
        context.set_details(details)
    raise exc from None


class ServeRoles:
    """The workflow roles as Serve deployment handles (colocated: both are the synthesizer's)."""

    def __init__(self, workers: DeploymentHandle, synthesizer: DeploymentHandle):
        self.workers, self.synth = workers, synthesizer

    async def info(self) -> SynthesizerInfo:
        return await self.synth.info.remote()

    def branches(self, req: BranchRequest):
        return self.workers.options(stream=True).run_branches.remote(req)

    def synthesis(self, req: SynthesisRequest):
        return session_handle(self.synth, req.session).options(stream=True).synthesize.remote(req)


def session_handle(handle: DeploymentHandle, session_id: str) -> DeploymentHandle:
    """The handle a session's call goes through: routed to the replica that serves the session (Serve's
    multiplexing, keyed by session id), any replica for a call that opens a new session."""
    return handle.options(multiplexed_model_id=session_id) if session_id else handle


@serve.deployment(name="AgentIngress")
class AgentIngress:
    def __init__(self, workers: DeploymentHandle, synthesizer: DeploymentHandle, config: WorkflowConfig,
                 redis_url: str, session_ttl_s: int, model_path: str, api_keys_file: str | None = None):
        from transformers import AutoTokenizer

        self.synth = synthesizer
        self.keys = ApiKeys.load(api_keys_file)  # (and $BRAID_API_KEYS); None: open
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.workflows = WorkflowDriver(ServeRoles(workers, synthesizer), Directory.connect(redis_url, session_ttl_s),
                                        config, lambda text: tokenizer.encode(text, add_special_tokens=False),
                                        chat_renderer(tokenizer, model_path))
        self.workflows.metrics = metrics()
        if config.record_dir:  # (one file per ingress replica: replicas never write the same file)
            replica = serve.get_replica_context().replica_id.unique_id
            self.workflows.recorder = TraceRecorder(config.record_dir, replica,
                                                    on_drop=lambda n: self.workflows.metrics["trace_drops"].inc(n))

    @staticmethod
    def _timeout(grpc_context) -> float | None:
        """The client's deadline (metadata braid-timeout-ms), read before any work is dispatched."""
        return request_timeout(grpc_context.invocation_metadata() if grpc_context is not None else None)

    @staticmethod
    async def _bounded(stream, timeout: float | None):
        """The stream, ended at the client's deadline with DEADLINE_EXCEEDED; ending it, for any reason, cancels
        the request's work on every replica."""
        end = None if timeout is None else asyncio.get_running_loop().time() + timeout
        try:
            while True:
                left = None if end is None else end - asyncio.get_running_loop().time()
                try:
                    item = await asyncio.wait_for(anext(stream), left)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if end is None or asyncio.get_running_loop().time() < end:
                        raise  # (the work's own timeout, not the client's deadline)
                    raise DeadlineError(f"the request's deadline ({1e3 * timeout:.0f} ms) passed; its work was "
                                        "stopped on every replica") from None
                yield item
        finally:
            if hasattr(stream, "aclose"):
                await stream.aclose()
            elif hasattr(stream, "cancel"):  # a Serve response stream
                stream.cancel()

    def _authenticate(self, grpc_context) -> str:
        """Every RPC, before any work: a missing or wrong key is UNAUTHENTICATED. Returns the key's name (the
        caller, whose sessions are its own; "" on an open API)."""
        if self.keys is None:
            return ""
        return self.keys.check(grpc_context.invocation_metadata() if grpc_context is not None else None)

    # ---- session-level calls: routed to the synthesizer replica that serves the session ----
    async def _unary(self, name, request, grpc_context):
        try:
            caller, timeout = self._authenticate(grpc_context), self._timeout(grpc_context)
            response = session_handle(self.synth, getattr(request, "session_id", "")).agent_unary.remote(
                name, request, caller)
            try:
                return await asyncio.wait_for(response, timeout)
            except TimeoutError:
                if timeout is None:
                    raise
                response.cancel()  # (a unary call already running on its replica finishes there)
                raise DeadlineError(f"the request's deadline ({1e3 * timeout:.0f} ms) passed") from None
        except Exception as e:  # noqa: BLE001 - every failure becomes a status
            _fail(grpc_context, e)

    async def _stream(self, name, request, grpc_context):
        try:
            caller, timeout = self._authenticate(grpc_context), self._timeout(grpc_context)
            handle = session_handle(self.synth, getattr(request, "session_id", "")).options(stream=True)
            async for event in self._bounded(handle.agent_stream.remote(name, request, caller), timeout):
                yield event
        except Exception as e:  # noqa: BLE001
            _fail(grpc_context, e)

    async def Health(self, request, grpc_context=None):
        return await self._unary("Health", request, grpc_context)

    async def Prefill(self, request, grpc_context=None):
        return await self._unary("Prefill", request, grpc_context)

    async def GetMessage(self, request, grpc_context=None):
        return await self._unary("GetMessage", request, grpc_context)

    async def ListSessions(self, request, grpc_context=None):
        return await self._unary("ListSessions", request, grpc_context)

    async def CloseSession(self, request, grpc_context=None):
        return await self._unary("CloseSession", request, grpc_context)

    async def Decode(self, request, grpc_context=None):
        async for event in self._stream("Decode", request, grpc_context):
            yield event

    async def Generate(self, request, grpc_context=None):
        async for event in self._stream("Generate", request, grpc_context):
            yield event

    async def RunAgents(self, request, grpc_context=None):
        async for event in self._stream("RunAgents", request, grpc_context):
            yield event

    async def RunGraph(self, request, grpc_context=None):
        async for event in self.workflows.record_graph(request, self._stream("RunGraph", request, grpc_context)):
            yield event

    async def RunWorkflow(self, request: pb.WorkflowRequest, grpc_context=None):
        try:
            caller, timeout = self._authenticate(grpc_context), self._timeout(grpc_context)
            async for event in self._bounded(self.workflows.run(request, caller), timeout):
                yield event
        except Exception as e:  # noqa: BLE001
            _fail(grpc_context, e)
