"""RunWorkflow, once: validate, choose the transport, fan the branches out to workers, stream the answer.

The driver talks to two roles through `Roles`: workers (`branches`) and a synthesizer
(`synthesis`, `info`). Behind Serve they are deployment handles (braid.api.ingress);
in one process they are runners called on threads (`ThreadRoles`). Colocated, the
synthesizer's replicas play both roles and KV moves by the "local" transport.

A request's hops: validate (convert.workflow) -> decision event -> open the synthesis
(KV modes: its receiver's address) -> branch groups on workers, their tokens streamed
-> (text mode: open the synthesis with the replies) -> receipts, answer tokens, timings,
done (the answer alone).
"""

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

from braid.api.decision import DecisionInput, decide
from braid.kv.connector import ReceiverLostError, TransferError, Transport, stream_name
from braid.kv.grpc_transport import abandon
from braid.methods.staircase import StaircaseSchedule
from braid.methods.synthesis import SynthesisMode
from braid.models.chat import WORKER_HEADER, ChatRenderer
from braid.protos import agent_pb2 as pb
from braid.runtime import convert
from braid.runtime.aio import in_thread, merge
from braid.runtime.directory import Directory
from braid.runtime.messages import (
    AnswerToken,
    BranchDone,
    BranchRequest,
    BranchToken,
    KVArrived,
    SynthesisDone,
    SynthesisRequest,
    SynthesisRound,
    SynthesizerInfo,
)
from braid.runtime.quotas import KeyLimits
from braid.runtime.traces import GraphTrace, TraceRecorder, WorkflowTrace

log = logging.getLogger(__name__)
# the cluster's kv_transport: auto (decided per request), or one transport for every request (local is the
# colocated cluster's own, not a setting)
TRANSPORTS = ("auto", *(str(t) for t in Transport if t is not Transport.LOCAL))


@dataclass
class WorkflowConfig:
    """What the ingress needs of the cluster's config."""

    kv_transport: str = "auto"  # auto: grpc or text per request; or always grpc, collective or text
    colocated: bool = False  # the synthesizer's engines run the branches too (transport "local")
    branch_groups: int = 1  # branches are spread over this many worker calls (the worker replicas)
    default_max_tokens: int = 128
    max_branches: int = 16
    worker_header: str = WORKER_HEADER
    limits: KeyLimits = KeyLimits()  # what each API key may hold at once
    staircase: StaircaseSchedule = StaircaseSchedule(strict=False)  # a staircase request's, where it sets none
    record_dir: str = ""  # where the ingress records the workflows and graphs it serves (runtime.traces; "": nowhere)

    def __post_init__(self):
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"kv_transport {self.kv_transport!r} is not one of {TRANSPORTS}")
        self.configured = None if self.kv_transport == "auto" else Transport.named(self.kv_transport)  # None: auto
        for name in ("branch_groups", "default_max_tokens", "max_branches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Roles(Protocol):
    async def info(self) -> SynthesizerInfo: ...

    def branches(self, req: BranchRequest) -> AsyncIterator[BranchToken | BranchDone]: ...

    def synthesis(self, req: SynthesisRequest) -> AsyncIterator: ...


def cause(exc: BaseException) -> BaseException:
    """The exception a replica raised, out of Ray's wrapper."""
    found = getattr(exc, "cause", None)
    return found if isinstance(found, BaseException) else exc


def replica_lost(exc: BaseException) -> bool:
    """Whether `exc` says that the replica serving a call died under it (Ray's actor errors: killed, crashed,
    unreachable), rather than that the call itself failed: the client may retry it elsewhere."""
    errors = sys.modules.get("ray.exceptions")  # (only where Ray is in use: an in-process server never loads it)
    return errors is not None and any(isinstance(e, errors.RayActorError) for e in (exc, cause(exc)))


class WorkflowDriver:
    def __init__(self, roles: Roles, directory: Directory, config: WorkflowConfig, tokenize: Callable[[str], list],
                 renderer: ChatRenderer | str = "this server renders no chat messages"):
        """`renderer`: the model's chat template, one message at a time (models.chat.chat_renderer), for workflows
        sent as chat messages; or why the model has none."""
        self.roles, self.directory, self.config, self.tokenize = roles, directory, config, tokenize
        self.renderer = renderer
        self.recorder: TraceRecorder | None = None  # set where the cluster records what it serves (record_dir)
        self.metrics = None  # set by a Serve ingress: braid.runtime.metrics

    async def run(self, request: pb.WorkflowRequest, caller: str = "") -> AsyncIterator[pb.WorkflowEvent]:
        """One workflow for `caller` (the API key's name; "" on an open API): its session is the caller's, and
        it counts against the caller's limit of running workflows while it runs."""
        # (aclosing: a client that leaves closes every inner stage now, not when the garbage collector runs)
        with self.directory.running(caller, self.config.limits.workflows):
            async with aclosing(self._run(request, caller)) as events:
                async for event in events:
                    yield event

    async def _run(self, request: pb.WorkflowRequest, caller: str) -> AsyncIterator[pb.WorkflowEvent]:
        start = time.perf_counter()
        cfg = self.config
        info = await self.roles.info()
        wf = convert.workflow(request, info, self.tokenize, cfg.worker_header, cfg.default_max_tokens,
                              cfg.max_branches, cfg.colocated, cfg.staircase, self.renderer)
        trace = WorkflowTrace(request, info.fingerprint, info.calibration_digest,
                              wf.worker_header or cfg.worker_header) if self.recorder else None
        with self.directory.session_for_call(wf.session, caller, cfg.limits) as session:
            async with aclosing(self._workflow(wf, info, session, start)) as events:
                async for event in events:
                    if trace is not None:
                        trace.see(event)
                    yield event
        if trace is not None and trace.done:  # (a workflow that failed or was left is not recorded)
            self.recorder.record(trace.line)

    async def record_graph(self, request: pb.GraphRequest,
                           events: AsyncIterator[pb.GraphEvent]) -> AsyncIterator[pb.GraphEvent]:
        """A RunGraph request's events as they come (`events`: the graph's run), recorded where the cluster records
        what it serves (runtime.traces.GraphTrace). A graph that fails, is left midway, or is refused is not."""
        trace, started = None, False
        async with aclosing(events) as stream:
            async for event in stream:
                if self.recorder is not None and not started:  # (made at the first event: the caller has been let in)
                    started = True
                    try:
                        graph = convert.graph(request, self.config.default_max_tokens, self.config.staircase,
                                              self.renderer)
                        info = await self.roles.info()
                        trace = GraphTrace(graph, info.fingerprint, info.calibration_digest)
                    except Exception as e:  # noqa: BLE001 - (recording never fails a request)
                        log.warning("a graph is not recorded: %s: %s", type(e).__name__, e)
                if trace is not None:
                    trace.see(event)
                yield event
        if trace is not None and trace.done:
            self.recorder.record(trace.line)

    async def _workflow(self, wf: convert.Workflow, info: SynthesizerInfo, session: str,
                        start: float) -> AsyncIterator[pb.WorkflowEvent]:
        cfg = self.config
        n = wf.num_branches
        decision = decide(DecisionInput(wf.transport, cfg.configured, cfg.colocated, n, wf.branch_limit,
                                        wf.placement.value, wf.staircase is not None, info))
        transport = decision.transport  # (from here on, carried as it is: to the workers, the synthesizer, metrics)
        yield pb.WorkflowEvent(decision=pb.Decision(transport=transport, reason=decision.reason))
        if self.metrics:
            self.metrics["requests"].inc(tags={"transport": str(transport)})
        synth_req = SynthesisRequest(wf.id, session, wf.task, wf.synthesis_prompt,
                                     SynthesisMode(wf.placement if transport.ships else None), wf.answer_sampling, n,
                                     transport, staircase=wf.staircase, text_over=decision.text_over,
                                     branch_prompts=list(wf.prompts))
        synth, kv_address, finished = None, "", False
        try:
            if transport.ships:  # open the synthesis first: its receiver is where the workers push
                synth = aiter(self.roles.synthesis(synth_req))
                kv_address = (await anext(synth)).kv_address
            groups = [list(range(g, n, cfg.branch_groups)) for g in range(min(n, cfg.branch_groups))]
            calls = [self.roles.branches(BranchRequest(wf.id, wf.task, group, [wf.prompts[j] for j in group],
                                                       wf.worker_sampling, transport, kv_address, wf.worker_header))
                     for group in groups]
            done: dict[int, BranchDone] = {}
            answer = _Answer(start, transport, self.metrics)
            # a staircase answers while the branches decode: its stream is merged with theirs. Its receipts are
            # checked as soon as the branch's own report is in; its done waits until every branch has ended
            stair = wf.staircase is not None
            streams = [*(_worker_failures(c, g, stair) for c, g in zip(calls, groups)), *([synth] if stair else [])]
            receipts: dict[int, KVArrived] = {}
            failed: dict[int, str] = {}  # branches a staircase answers without, and why
            later = []
            async with aclosing(merge(streams)) as merged:
                async for item in merged:
                    if isinstance(item, BranchToken):
                        yield pb.WorkflowEvent(branch_token=pb.BranchToken(
                            branch=item.branch, token_id=item.token_id, text=item.text,
                            finish_reason=item.finish_reason))
                    elif isinstance(item, BranchDone):
                        done[item.branch], answer.branches_done = item, time.perf_counter()
                        if item.branch in receipts:
                            yield answer.receipt(receipts.pop(item.branch), item)
                    elif isinstance(item, KVArrived):
                        if item.branch in done:
                            yield answer.receipt(item, done[item.branch])
                        else:
                            receipts[item.branch] = item
                    elif isinstance(item, SynthesisRound):
                        yield pb.WorkflowEvent(round=pb.StaircaseRound(round=item.round, chunks=[
                            pb.BranchChunk(branch=j, start=a, end=b) for j, (a, b) in item.chunks.items()]))
                    elif isinstance(item, AnswerToken):
                        yield answer.token(item)
                    elif isinstance(item, _Lost):
                        lost = [j for j in item.branches if j not in done and j not in failed]
                        for j in lost:
                            failed[j] = item.reason
                            yield pb.WorkflowEvent(branch_failed=pb.BranchFailed(branch=j, reason=item.reason))
                        if lost:  # the synthesizer stops waiting for them at once
                            await asyncio.to_thread(abandon, kv_address, [stream_name(wf.id, j) for j in lost],
                                                    item.reason)
                    else:
                        later.append(item)
            stray = sorted(set(receipts) - set(failed))  # (a lost branch's KV may have come whole: not checked)
            if stray:
                raise TransferError(f"branches {stray}: KV arrived that no worker reported sending")
            if synth is None:
                synth_req.branch_tokens = [done[j].token_ids for j in range(n)]
                synth = aiter(self.roles.synthesis(synth_req))
                await anext(synth)  # the receiver's address, unused in text mode
            async for item in _chain(later, synth if wf.staircase is None else None):
                if isinstance(item, KVArrived):
                    yield answer.receipt(item, done[item.branch])
                elif isinstance(item, AnswerToken):
                    yield answer.token(item)
                elif isinstance(item, SynthesisDone):
                    finished = True
                    for j, why in sorted(item.failed.items()):  # (lost to the synthesizer: its KV failed)
                        if j not in failed:
                            failed[j] = why
                            yield pb.WorkflowEvent(branch_failed=pb.BranchFailed(branch=j, reason=why))
                    yield answer.timings()
                    yield pb.WorkflowEvent(done=pb.WorkflowDone(
                        session_id=session, answer_message_id=item.answer_id, answer_text=item.answer_text,
                        branch_message_ids=item.branch_ids,  # (a branch lost after its KV had all come is kept)
                        text_branches=item.text_branches,
                        failed_branches=[pb.BranchFailed(branch=j, reason=why) for j, why in sorted(failed.items())]))
        except BaseException as e:  # a failure, or the client went away (GeneratorExit)
            if kv_address and not finished:  # the synthesizer may be waiting on streams no one will send
                if hasattr(synth, "cancel"):
                    synth.cancel()
                await asyncio.to_thread(abandon, kv_address, [stream_name(wf.id, j) for j in range(n)],
                                        f"{type(cause(e)).__name__}: {cause(e)}")
            raise
        finally:
            if synth is not None and hasattr(synth, "aclose"):
                await synth.aclose()


class _Answer:
    """A workflow's answer as it streams to the client: its token events, receipts and timings."""

    def __init__(self, start: float, transport: Transport, metrics):
        self.start, self.transport, self.metrics = start, transport, metrics
        self.first = self.last = self.branches_done = None
        self.kv_bytes, self.kv_ms = 0, 0.0

    def token(self, item: AnswerToken) -> pb.WorkflowEvent:
        now = time.perf_counter()
        if self.metrics and self.first is not None:
            self.metrics["itl"].observe(now - self.last, tags={"transport": str(self.transport)})
        self.first, self.last = self.first or now, now
        return pb.WorkflowEvent(synthesis_token=pb.TokenEvent(token_id=item.token_id, text=item.text,
                                                              finish_reason=item.finish_reason,
                                                              message_id=item.message_id))

    def receipt(self, item: KVArrived, sent: BranchDone) -> pb.WorkflowEvent:
        """A branch's KV receipt for the client, with the digest of what arrived and of what was sent (the KV
        receiver checked that they are equal before the synthesizer took the branch in)."""
        self.kv_bytes, self.kv_ms = self.kv_bytes + item.bytes, max(self.kv_ms, item.transfer_ms)
        return pb.WorkflowEvent(kv_receipt=pb.KVReceipt(
            branch=item.branch, bytes=item.bytes, crc32=item.digest, crc32_sent=sent.digest,
            transfer_ms=item.transfer_ms, transport=item.transport))

    def timings(self) -> pb.WorkflowEvent:
        if self.metrics:
            self.metrics["ttft"].observe(self.first - self.start, tags={"transport": str(self.transport)})
        last = self.branches_done if self.branches_done is not None else time.perf_counter()  # (every branch lost)
        return pb.WorkflowEvent(timings=pb.Timings(
            ttft_ms=1e3 * (self.first - self.start),
            last_branch_to_first_token_ms=1e3 * (self.first - last),
            kv_transfer_ms=self.kv_ms, kv_bytes=self.kv_bytes))


@dataclass
class _Lost:
    """A worker call failed in a staircase workflow: the answer goes on without its branches not yet done."""
    branches: list[int]
    reason: str


async def _worker_failures(stream, branches: list[int], staircase: bool) -> AsyncIterator:
    """A worker call's items. Its failure abandons the workflow, saying so; in a staircase it loses only its
    own branches (one _Lost item)."""
    try:
        async for item in stream:
            yield item
    except Exception as e:  # noqa: BLE001
        why = f"{type(cause(e)).__name__}: {cause(e)}"
        if replica_lost(e) and not staircase:
            raise TransferError(f"a worker failed mid-request: the replica running its branches was lost (killed, "
                                f"crashed or replaced), so this workflow was abandoned; retry it: {why}") from None
        if isinstance(cause(e), ReceiverLostError) and not staircase:  # (the worker is fine: its synthesizer is not)
            raise TransferError(f"the synthesizer replica serving this workflow was lost mid-request (its workers "
                                f"could not ship KV to it), so this workflow was abandoned; retry it: {why}") from None
        if not staircase:
            raise TransferError(f"a worker failed mid-request, so this workflow was abandoned: {why}") from None
        yield _Lost(branches, f"its worker failed mid-stream: {why}")
    finally:  # (Serve's response streams cancel; in-process ones close)
        if hasattr(stream, "cancel"):
            stream.cancel()
        if hasattr(stream, "aclose"):
            await stream.aclose()


async def _chain(items: list, stream) -> AsyncIterator:
    for item in items:
        yield item
    if stream is not None:
        async for item in stream:
            yield item


@dataclass
class ThreadRoles:
    """The roles in this process: runners' blocking generators, each call on its own thread."""

    run_branches: Callable[[BranchRequest], Iterator]
    synthesize: Callable[[SynthesisRequest], Iterator]
    get_info: Callable[[], SynthesizerInfo]

    async def info(self) -> SynthesizerInfo:
        return self.get_info()

    def branches(self, req: BranchRequest) -> AsyncIterator:
        return in_thread(lambda: self.run_branches(req))

    def synthesis(self, req: SynthesisRequest) -> AsyncIterator:
        return in_thread(lambda: self.synthesize(req))
