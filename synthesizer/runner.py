"""The synthesizer role over one engine (Ray-free): take in the branches (KV or text) and decode the answer."""

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from braid.engine import Engine, PrefillCall
from braid.engine.config import OWN_VERIFICATION
from braid.engine.errors import BraidError
from braid.kv.connector import ReceivedStream, Transport, stream_name
from braid.kv.receiver import KVReceiver
from braid.methods.calibration import served_refresh
from braid.methods.staircase import BranchFeed, RoundTaken, StaircaseResult, staircase
from braid.methods.synthesis import (
    Placement,
    Refresh,
    SynthesisMode,
    SynthesisRecord,
    read_at,
    read_from_text,
    synthesis_stream,
)
from braid.runtime.messages import (
    AnswerToken,
    KVArrived,
    SynthesisDone,
    SynthesisOpened,
    SynthesisRequest,
    SynthesisRound,
    SynthesizerInfo,
)
from braid.runtime.directory import Lineage
from braid.runtime.sessions import Sessions

log = logging.getLogger(__name__)


@dataclass
class SynthesizerConfig:
    kv_wait_timeout_s: float = 120.0  # a started branch stream may go this long without a chunk
    kv_queue_timeout_s: float = 3600.0  # how long a branch may wait for a worker to start on it
    # the cache path re-encodes this many tokens at each end of every branch (0: off); None: as many as the loaded
    # calibration was trained with (Calibration.refresh), one without a calibration
    refresh_tokens: int | None = None
    # RunGraph: each plain decoding wave is dealt over at most this many Worker calls (synthesizer.waves), its
    # outputs shipped back over `graph_transport`; 0: graphs decode on this replica
    graph_worker_calls: int = 0
    graph_transport: Transport = Transport.GRPC  # GRPC or COLLECTIVE (Transport.remote)

    def __post_init__(self):
        for name in ("kv_wait_timeout_s", "kv_queue_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.refresh_tokens is not None and (not isinstance(self.refresh_tokens, int) or self.refresh_tokens < 0):
            raise ValueError(f"refresh_tokens must be an int >= 0 or unset, got {self.refresh_tokens!r}")
        if self.graph_worker_calls < 0:
            raise ValueError(f"graph_worker_calls must be >= 0 (0: graphs decode here), got {self.graph_worker_calls}")
        if not isinstance(self.graph_transport, Transport) or not self.graph_transport.remote:
            raise ValueError(f"graph_transport must be Transport.GRPC or COLLECTIVE, got {self.graph_transport!r}")


class SynthesisRunner:
    """Runs SynthesisRequests on `engine`; the Synthesizer deployment hosts one. Branch messages and the
    answer are registered in the request's session through `sessions` (this replica's, runtime.sessions)."""

    def __init__(self, engine: Engine, receiver: KVReceiver, sessions: Sessions, config: SynthesizerConfig):
        self.engine, self.receiver, self.sessions, self.config = engine, receiver, sessions, config
        self.prefill_tokens_per_s = self._measure_prefill()
        self.link_bytes_per_s: float | None = None  # from completed transfers

    def _measure_prefill(self, tokens: int = 256) -> float:
        rates = []
        for run in range(2):  # the first run warms up; each its own tokens, so the prefix cache cannot answer
            ids = [3 + (i + 101 * run) % (self.engine.spec.vocab_size - 3) for i in range(tokens)]
            start = time.perf_counter()
            mid, = self.engine.prefill([PrefillCall(ids)])
            rates.append(tokens / (time.perf_counter() - start))
            self.engine.free(mid)
        return rates[-1]

    def info(self) -> SynthesizerInfo:
        s, attached = self.engine.spec, self.engine.calibration
        return SynthesizerInfo(self.engine.fingerprint, s.max_positions, s.vocab_size, self.engine.kv_bytes_per_token,
                               self.prefill_tokens_per_s, self.link_bytes_per_s, self.calibration_name,
                               attached.record.placement.value if attached else Placement.BRANCH_POINT.value,
                               attached.record.verified_for(self.refresh) if attached else 0,
                               attached.record.verified_tokens if attached else 0,
                               attached.record.verified_placement if attached else "",
                               attached.record.digest if attached else "")

    @property
    def refresh(self) -> Refresh | None:
        """The boundary refresh the cache path is served with (None: off): the config's, else the one the
        calibration was trained to read, else a token at each end."""
        return served_refresh(self.engine.calibration, self.config.refresh_tokens)

    @property
    def calibration_name(self) -> str:
        """The calibration as the transport decision's reasons name it: its path, and the verification its gate
        reads where that is a named one (EngineConfig.verification)."""
        attached = self.engine.calibration
        if attached is None:
            return ""
        c = attached.record
        return c.path if c.verification_name == OWN_VERIFICATION else f"{c.path} (verification {c.verification_name})"

    def _receive(self, stream_id: str) -> ReceivedStream:
        """A branch's whole KV stream (TransferError if it failed or timed out); its link rate is recorded."""
        got = self.receiver.wait(stream_id, self.config.kv_wait_timeout_s, self.config.kv_queue_timeout_s)
        rate, old = got.link_bytes_per_s, self.link_bytes_per_s
        if rate is not None:
            self.link_bytes_per_s = rate if old is None else 0.8 * old + 0.2 * rate
        return got

    def _mode(self, req: SynthesisRequest) -> SynthesisMode:
        """The request's mode as served: the cache path calibrated and its branch boundaries re-encoded."""
        mode, eng = req.mode, self.engine
        if not mode.text and mode.hooks is None and eng.calibration is not None:
            mode = replace(mode, hooks=eng.calibration.hooks)
        if not mode.text and mode.refresh is None:
            mode = replace(mode, refresh=self.refresh)
        if not mode.text and req.text_over:
            mode = replace(mode, refresh=replace(mode.refresh or Refresh(0, 0), whole_over=req.text_over))
        return mode

    @staticmethod
    def _receipts(received: dict[int, ReceivedStream]) -> Iterator[KVArrived]:
        for j, got in received.items():
            if got.kv is not None:
                yield KVArrived(j, got.bytes, got.digest, 1e3 * got.tail_seconds, got.transport)

    def _lineages(self, req: SynthesisRequest, prefix: list[str], branches: list[str], answer: str = "",
                  mode: SynthesisMode | None = None) -> dict[str, Lineage]:
        """What the branches' and the answer's own messages do not record, for the session's record of them: each
        branch was decoded after the task (the prefix, encoded here from the same tokens) and its prompt, which
        the worker freed (its context); a cache-path answer read the branches through its synthesis (placement,
        refresh, calibration), which is replayed to encode it again. A branch whose prompt does not end where it
        begins, or an answer read through hooks that are not the calibration's, keeps its message's record."""
        eng, out = self.engine, {}
        n = sum(eng.message(p).num_tokens for p in prefix)
        at = tuple(eng.message(p).offset for p in prefix)
        for j, mid in enumerate(branches):
            m = eng.message(mid) if mid else None
            context = tuple(eng.tokenize(req.branch_prompts[j])) if j < len(req.branch_prompts) else ()
            if m is not None and context and m.offset == n + len(context):
                out[mid] = Lineage(m.token_ids, m.offset, tuple(prefix), at, context=context)
        attached = eng.calibration
        calibrated = mode is not None and attached is not None and mode.hooks is attached.hooks
        if answer and mode is not None and not mode.text and all(b in out for b in branches) \
                and (mode.hooks is None or calibrated):
            a = eng.message(answer)
            record = SynthesisRecord(tuple(prefix), tuple(branches), mode.placement, mode.refresh,
                                     attached.record.digest if calibrated else "")
            out[answer] = Lineage(a.token_ids, a.offset, (*prefix, *branches),
                                  tuple(read_at(eng, prefix, branches, mode.placement)), synthesis=record)
        return out

    def run(self, req: SynthesisRequest) -> Iterator[SynthesisOpened | KVArrived | SynthesisRound | AnswerToken
                                                     | SynthesisDone]:
        """Yields where to push KV first; then, in KV modes, one KVArrived per copied branch; the answer's
        tokens; and SynthesisDone. A staircase answers first, from the chunks as they arrive, with a
        SynthesisRound before each answer chunk; its KVArrived come once the branches are complete."""
        eng = self.engine
        yield SynthesisOpened(self.receiver.address)
        if req.staircase is not None:
            yield from self._staircase(req)
            return
        received = {} if req.mode.text else {j: self._receive(stream_name(req.workflow, j))
                                             for j in range(req.branches)}
        yield from self._receipts(received)
        prefix = eng.prefill([PrefillCall(req.task)])
        branches = [self.receiver.import_message(eng, g) for g in received.values()]
        mode = self._mode(req)
        stream = synthesis_stream(eng, branches or req.branch_tokens, req.prompt, prefix=prefix, mode=mode,
                                  sampling=req.sampling)
        text_branches = list(range(req.branches)) if mode.text else read_from_text(eng, branches, prefix, mode)
        answer = []
        for event in stream:
            answer.append(event.text)
            yield AnswerToken(event.token_id, event.text, event.finish_reason or "", event.message_id or "")
        registered = self.sessions.register(req.session, prefix + branches + stream.ids,
                                            self._lineages(req, prefix, branches, stream.ids[0], mode))
        tpot = stream.timings["decode"] / (len(answer) - 1) if len(answer) > 1 else None
        yield SynthesisDone(stream.ids[0], "".join(answer), branches, tpot, registered, text_branches=text_branches)

    def _staircase(self, req: SynthesisRequest) -> Iterator[KVArrived | SynthesisRound | AnswerToken | SynthesisDone]:
        """The answer from the branches' KV chunks as they arrive (methods.staircase), then the whole branches'
        receipts, and the branches stored and registered with the answer, as the waiting path stores them. A
        branch lost midway (its worker failed, or its KV; the ingress abandons the streams of a worker call that
        failed) is left out: the answer goes on with the others, and SynthesisDone says which were lost and why.
        A run that fails (every branch lost) or is left midway keeps nothing here."""
        eng, (schedule, variant) = self.engine, req.staircase
        ids = [stream_name(req.workflow, j) for j in range(req.branches)]
        arrivals = [self.receiver.watch(sid) for sid in ids]
        feed = BranchFeed([], pump=False, branches=[(a, 0) for a in arrivals])
        for a in arrivals:
            a.listen(lambda a=a: feed.arrived(a))
        result, answer, prefix, stored, done = StaircaseResult(), [], [], {}, False
        try:
            prefix = eng.prefill([PrefillCall(req.task)])
            for event in staircase(eng, feed, req.prompt, prefix, schedule, variant, self._mode(req), req.sampling,
                                   idle_s=self.config.kv_wait_timeout_s, queued_s=self.config.kv_queue_timeout_s,
                                   result=result):
                if isinstance(event, RoundTaken):
                    yield SynthesisRound(event.round, event.chunks)
                else:
                    answer.append(event.text)
                    yield AnswerToken(event.token_id, event.text, event.finish_reason or "", event.message_id or "")
            failed = dict(feed.failed)  # (a superset of result.failed: some may have failed after the last round)
            self.receiver.forget([ids[j] for j in failed])
            received = {}
            for j in range(req.branches):
                if j not in failed:
                    try:
                        received[j] = self._receive(ids[j])
                    except BraidError as e:  # lost after the answer took in what it could
                        failed[j] = f"{type(e).__name__}: {e}"
            yield from self._receipts(received)
            for j, got in received.items():  # (one by one: a failure midway frees those already in)
                stored[j] = self.receiver.import_message(eng, got)
            registered = self.sessions.register(req.session, prefix + list(stored.values()) + result.message_ids[-1:],
                                                self._lineages(req, prefix, [stored.get(j, "") for j in
                                                                             range(req.branches)]))
            done = True
        finally:
            if not done:
                self.receiver.forget(ids)
                eng.discard(prefix + list(stored.values()) + result.message_ids[-1:])
        if failed:
            log.warning("workflow %s: the staircase answered without branches %s: %s", req.workflow, sorted(failed),
                        "; ".join(failed[j] for j in sorted(failed)))
        yield SynthesisDone(result.message_ids[-1], "".join(answer), [stored.get(j, "") for j in range(req.branches)],
                            None, registered, failed)
