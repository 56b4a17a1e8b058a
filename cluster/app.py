"""The Ray Serve application: a gRPC ingress wired to Worker and Synthesizer deployments."""

import asyncio
import logging
import secrets
import time

from ray import serve
from ray.serve.handle import DeploymentHandle

from braid.api import convert
from braid.cluster.config import ClusterConfig
from braid.api.decision import choose_transport
from braid.api.directory import Directory
from braid.api.grpc_server import grpc_status
from braid.kv.grpc_transport import TransferError
from braid.api.metrics import metrics
from braid.engine.errors import BraidError
from braid.protos import agent_pb2 as pb
from braid.synthesizer.deployment import Synthesizer
from braid.workers.deployment import Worker

log = logging.getLogger(__name__)
SERVICER = "braid.protos.agent_pb2_grpc.add_AgentServiceServicer_to_server"


def _cause(exc: Exception) -> Exception:
    """The exception a replica raised, out of Ray's wrapper."""
    return getattr(exc, "cause", None) or exc


def _fail(context, exc: Exception):
    """Raise with the status a client should see; Serve's proxy keeps a code set before raising."""
    cause = _cause(exc)
    if context is not None:
        code, details = grpc_status(cause)
        context.set_code(code)
        context.set_details(details)
    raise cause from None


@serve.deployment(name="AgentIngress")
class AgentIngress:
    """Method names equal the RPC names: Serve's gRPC proxy calls them with the request proto."""

    def __init__(self, worker: DeploymentHandle | None, synthesizer: DeploymentHandle, config: ClusterConfig,
                 redis_url: str):
        self.worker, self.synth, self.config = worker, synthesizer, config
        self.directory = Directory.connect(redis_url, config.session_ttl_s)

    # ---- session-level calls: answered by the synthesizer that holds the session's messages ----
    async def _unary(self, name, request, grpc_context):
        try:
            return await self.synth.agent_unary.remote(name, request)
        except Exception as e:  # noqa: BLE001 - every failure becomes a status
            _fail(grpc_context, e)

    async def _stream(self, name, request, grpc_context):
        try:
            async for event in self.synth.options(stream=True).agent_stream.remote(name, request):
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

    # ---- the parallel-synthesis workflow ------------------------------------------------------
    async def RunWorkflow(self, request: pb.WorkflowRequest, grpc_context=None):
        if self.worker is None:  # colocated: the synthesizer's engine runs the branches too
            async for event in self._stream("RunWorkflow", request, grpc_context):
                yield event
            return
        try:
            async for event in self._workflow(request):
                yield event
        except Exception as e:  # noqa: BLE001
            _fail(grpc_context, e)

    async def _workflow(self, request: pb.WorkflowRequest):
        start = time.perf_counter()
        n = len(request.branch_prompts)
        params = convert.workflow_params(request, self.config.default_max_tokens, self.config.max_branches)
        if request.transport == pb.TRANSPORT_LOCAL:
            raise BraidError("TRANSPORT_LOCAL needs a colocated cluster (braid serve --colocate); use "
                             "TRANSPORT_GRPC, TRANSPORT_COLLECTIVE, TRANSPORT_TEXT or leave it unspecified")
        worker_sampling, answer_sampling = params.worker_sampling, params.answer_sampling
        sid = request.session_id or self.directory.create_session()
        self.directory.session(sid)

        info = await self.synth.info.remote()
        branch_tokens = n * worker_sampling.max_tokens
        transport, reason = choose_transport(request.transport, self.config.kv_transport,
                                             branch_tokens * info["kv_bytes_per_token"], branch_tokens,
                                             info["link_bytes_per_s"], info["prefill_tokens_per_s"])
        yield pb.WorkflowEvent(decision=pb.Decision(transport=transport, reason=reason))
        mode = pb.Transport.Name(transport).removeprefix("TRANSPORT_").lower()  # grpc, collective or text
        kv_mode = mode != "text"
        tags = {"transport": mode}
        metrics()["requests"].inc(tags=tags)
        workflow = secrets.token_hex(8)
        synth_req = {"workflow": workflow, "session": sid, "task": request.task or " ",
                     "prompt": request.synthesis_prompt, "placement": params.placement, "sampling": answer_sampling,
                     "mode": mode, "branches": n}
        synth, kv_address = None, None
        if kv_mode:  # open the synthesis first: its replica's KV endpoint is where workers push
            synth = self.synth.options(stream=True).synthesize.remote(synth_req)
            kv_address = (await synth.__anext__())["kv_address"]
        # Branches are spread over the worker replicas; each group decodes in one batch.
        groups = [list(range(j, n, self.config.worker_replicas)) for j in range(min(n, self.config.worker_replicas))]
        workers = [self.worker.options(stream=True).run_branches.remote({
            "task": request.task or " ", "sampling": worker_sampling, "kv_address": kv_address, "transport": mode,
            "branches": [(j, request.branch_prompts[j], f"{workflow}:{j}") for j in group]}) for group in groups]
        done = {}
        try:
            async for item in _merge(workers):
                if "token" in item:
                    j, token, text, finish = item["token"]
                    yield pb.WorkflowEvent(branch_token=pb.BranchToken(branch=j, token_id=token, text=text,
                                                                       finish_reason=finish))
                else:
                    done[item["done"]["branch"]] = item["done"]
        except Exception as e:
            if synth is not None:
                synth.cancel()
            raise TransferError(f"a worker failed mid-request, so this workflow was abandoned: "
                                f"{type(_cause(e)).__name__}: {_cause(e)}") from None
        branches_done = time.perf_counter()
        if not kv_mode:
            synth_req["branch_tokens"] = [done[j]["token_ids"] for j in range(n)]
            synth = self.synth.options(stream=True).synthesize.remote(synth_req)
            await synth.__anext__()  # the KV endpoint, unused in text mode
        first = None
        kv_bytes = kv_ms = 0.0
        async for item in synth:
            if "receipts" in item:
                for r in item["receipts"]:
                    sent = done[r["branch"]]
                    if r["crc32"] != sent["crc32"] or r["bytes"] != sent["kv_bytes"]:
                        raise TransferError(f"branch {r['branch']}: KV arrived corrupted (crc32 {r['crc32']:#x}, "
                                            f"sent {sent['crc32']:#x})")
                    kv_bytes += r["bytes"]
                    kv_ms = max(kv_ms, r["transfer_ms"])
                    yield pb.WorkflowEvent(kv_receipt=pb.KVReceipt(
                        branch=r["branch"], bytes=r["bytes"], crc32=r["crc32"], crc32_sent=sent["crc32"],
                        transfer_ms=r["transfer_ms"]))
            elif "token" in item:
                first = first or time.perf_counter()
                token, text, finish, mid = item["token"]
                yield pb.WorkflowEvent(synthesis_token=pb.TokenEvent(token_id=token, text=text,
                                                                     finish_reason=finish, message_id=mid))
            else:
                d = item["done"]
                metrics()["ttft"].observe(first - start, tags=tags)
                yield pb.WorkflowEvent(timings=pb.Timings(
                    ttft_ms=1e3 * (first - start), last_branch_to_first_token_ms=1e3 * (first - branches_done),
                    kv_transfer_ms=kv_ms, kv_bytes=int(kv_bytes)))
                yield pb.WorkflowEvent(done=pb.WorkflowDone(session_id=sid, answer_message_id=d["answer_id"],
                                                            answer_text=d["answer_text"],
                                                            branch_message_ids=d["branch_ids"]))


async def _merge(generators):
    """Items from several Serve response generators as they arrive."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(gen):
        try:
            async for item in gen:
                await queue.put(item)
            await queue.put(None)
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put(e)

    tasks = [asyncio.create_task(pump(g)) for g in generators]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for g in generators:
            g.cancel()


def build_app(config: ClusterConfig, redis_url: str):
    """The Serve application. Workers and the synthesizer get a GPU each when GPUs exist;
    colocated, there are no Worker replicas and the synthesizer's engine does both jobs."""
    import torch

    gpu = 1 if torch.cuda.is_available() else 0
    synth = Synthesizer.options(num_replicas=config.synthesizer_replicas, ray_actor_options={
        "num_gpus": gpu if config.gpus_per_synthesizer is None else config.gpus_per_synthesizer, "num_cpus": 0})
    worker = None
    if not config.colocate:
        worker = Worker.options(num_replicas=config.worker_replicas, ray_actor_options={
            "num_gpus": gpu if config.gpus_per_worker is None else config.gpus_per_worker, "num_cpus": 0}).bind(config)
    return AgentIngress.bind(worker, synth.bind(config, redis_url), config, redis_url)
