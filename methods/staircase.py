"""Staircase Streaming: the aggregator answers from the branches' first chunks and takes in later
chunks as they arrive, from their text or their KV, re-prefilled into each branch's slot or appended after its
own output so far.

A round: wait for the branch chunks the schedule asks for, take in what every branch has decoded up to its
last chunk boundary (all of it once it ended), then decode one aggregator chunk. Round 0 waits for the first
chunk of m - r branches (`redundancy` r skips the slowest); every later round waits until each live branch has
a new chunk or has ended, as the paper's aggregator does.

Two variants:
- re-prefill: each round is one synthesis over every branch's tokens so far, each in its own slot, with the
  prompt and the answer so far as the header (recomputed; the prefix cache reuses what it can);
- append (the paper's prefix-caching template): the new chunks go after the chunks taken so far, in the order
  they came, and are never encoded again; the prompt and the answer so far follow them, re-encoded each round
  as in re-prefill. In KV mode the chunks' keys are re-rotated there, with the calibration's mapper applied
  when a mode carries one; in text mode each round's chunks are prefilled once, as one message.
KV modes read the chunks through the mode's hooks (mapper, adapter) and boundary refresh, as the cache path does.
A branch that fails mid-stream is left out from then on; once every branch has failed, the run fails.
"""

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch

from braid.engine.engine import DecodeCall, Engine, PrefillCall, TokenEvent, Tokens
from braid.engine.errors import BraidError, StoppedError, UnavailableError
from braid.engine.sampling import SamplingParams
from braid.methods.fanout import BranchStream
from braid.methods.synthesis import SynthesisMode, decode_with_hooks, refresh_branches, synthesis_stream


@dataclass(frozen=True)
class StaircaseSchedule:
    """Chunk sizes (the last repeats) for the proposers and the aggregator, and the first round's redundancy."""
    proposer: tuple[int, ...] = (8, 128, 256)
    aggregator: tuple[int, ...] = (8, 128)
    redundancy: int = 0  # round 0 waits for m - redundancy branches' first chunk
    # a redundancy the request asked for is refused where it leaves no branch to wait for; a server's default
    # (strict=False) waits for one branch there instead
    strict: bool = True

    def __post_init__(self):
        for name in ("proposer", "aggregator"):
            sizes = tuple(getattr(self, name))
            if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
                raise BraidError(f"staircase {name} chunk sizes must be positive integers, got {sizes}")
            object.__setattr__(self, name, sizes)
        if self.redundancy < 0:
            raise BraidError(f"staircase redundancy must be >= 0, got {self.redundancy}")

    def quorum(self, branches: int) -> int:
        """Branches whose first chunk round 0 waits for."""
        if self.redundancy >= branches and not self.strict:
            return 1  # (a server's default: wait for one)
        if self.redundancy >= branches:
            raise BraidError(f"staircase redundancy {self.redundancy} leaves no branch to wait for: this request "
                             f"has {branches}")
        return branches - self.redundancy

    def boundary(self, available: int) -> int:
        """The last proposer chunk boundary at or below `available` tokens (0 before the first chunk)."""
        at, k = 0, 0
        while True:
            size = self.proposer[min(k, len(self.proposer) - 1)]
            if at + size > available:
                return at
            at, k = at + size, k + 1

    def aggregator_chunk(self, round_: int) -> int:
        return self.aggregator[min(round_, len(self.aggregator) - 1)]


class Variant(str, Enum):
    REPREFILL = "reprefill"
    APPEND = "append"


@dataclass
class RoundTaken:
    """What one aggregator round saw: per branch, the token range [start, end) of its message taken in."""
    round: int
    chunks: dict[int, tuple[int, int]]


@dataclass
class StaircaseResult:
    answer: list[int] = field(default_factory=list)
    rounds: list[RoundTaken] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)  # branches that failed mid-stream, with why
    message_ids: list[str] = field(default_factory=list)  # the aggregator's messages, one per round; only the
    # last is kept (the answer), the earlier ones are freed as the run goes


class BranchSource(Protocol):
    """Calls whose messages a BranchFeed reads while they decode (call j: a branch), its message starting at
    position `offsets[j]`: `encoded(j)` of its tokens can be read so far, `partial_kv(j, start, end)` reads tokens
    [start, end) and their KV (None from a source that has only tokens: read as text)."""

    @property
    def offsets(self) -> Sequence[int]: ...

    def encoded(self, call: int) -> int: ...

    def partial_kv(self, call: int, start: int, end: int) -> tuple[list[int], torch.Tensor | None]: ...


class ReportedSource(BranchSource, Protocol):
    """A source whose token events someone iterates and reports to the feed (`BranchFeed.record` per token, `end`
    when it stops): a worker fan-out (`BranchStream`), a wave's decode call, a staircase's answer. The feed counts
    call j's message as its `header_length(j)` tokens and the tokens reported; `ids` is None until the source has
    ended with every call's message whole (a call that fails stores nothing: its last tokens never get their KV)."""

    @property
    def ids(self) -> list[str] | None: ...

    def header_length(self, call: int) -> int: ...


class ArrivingSource(BranchSource, Protocol):
    """A source that reports itself as it arrives from elsewhere (`BranchFeed.arrived`), such as a branch's KV
    received from its worker (kv.receiver.BranchArrivals): its message's whole `length` once it has all come
    (None before), its `error` once it failed."""

    @property
    def length(self) -> int | None: ...

    @property
    def error(self) -> BaseException | None: ...


class BranchFeed:
    """The branches the aggregator reads while they decode, numbered in order: how many of each branch message's
    tokens have KV, which have ended, which failed.

    A branch is call j of a BranchSource. Given fan-outs (`BranchStream`), the feed pumps each in its own thread;
    one that fails, or stops without finishing its branches, fails only its own branches. With `pump=False` the
    caller iterates the sources itself and reports to the feed (`record` per token, `end` when a source stops:
    ReportedSource), as methods.dag.streaming does for a wave several nodes stream, or the sources report
    themselves as they arrive (`arrived`: ArrivingSource).
    """

    def __init__(self, fan_outs: Sequence[BranchStream], pump: bool = True,
                 branches: Sequence[tuple[BranchSource, int]] | None = None):
        # branch -> (source, its call index there): every call of each source, or the `branches` given
        self.where = list(branches) if branches is not None else [(s, j) for s in fan_outs for j in range(len(s))]
        self.ended = [False] * len(self.where)
        self.length = [None] * len(self.where)  # an ended branch's message length (its last token's KV comes a
        # step after its last event)
        self.counts = [0] * len(self.where)
        self.failed: dict[int, str] = {}
        self.cancelled = False
        self.progressed = None  # when a branch last made progress (None: none has yet)
        self.started = time.monotonic()
        self.cv = threading.Condition()
        self.threads = []
        for stream in fan_outs if pump else ():
            thread = threading.Thread(target=self._pump, args=(stream,), daemon=True, name="staircase-feed")
            thread.start()
            self.threads.append(thread)

    def __len__(self) -> int:
        return len(self.where)

    def branch(self, source: BranchSource, call: int) -> int | None:
        """The feed's number for call `call` of `source` (None: the feed does not read it)."""
        return next((b for b, (s, j) in enumerate(self.where) if s is source and j == call), None)

    def record(self, source: ReportedSource, call: int, finished: bool) -> None:
        """One more token of call `call` of `source` (the pump's side: called as each token event arrives)."""
        b = self.branch(source, call)
        if b is None:
            return
        with self.cv:
            self.progressed = time.monotonic()
            self.counts[b] += 1
            if finished:  # (length first: `settled` reads both without the lock)
                self.length[b] = source.header_length(call) + self.counts[b]
                self.ended[b] = True
            self.cv.notify_all()

    def end(self, source: ReportedSource, why: str) -> None:
        """`source` stopped (the pump's side): its branches that had not ended with their KV stored fail, `why`."""
        with self.cv:
            self.progressed = time.monotonic()
            for b, (s, _) in enumerate(self.where):
                # not ended, or ended without its last token's KV (a call that failed stored nothing)
                if s is source and (not self.ended[b] or s.ids is None):
                    self.failed[b] = why
            self.cv.notify_all()

    def arrived(self, source: ArrivingSource, call: int = 0) -> None:
        """More of call `call` of `source` can be read (the receiving side's report, for a source read as it
        arrives from elsewhere: it knows its whole `length` once it has ended, and its `error` if it failed)."""
        b = self.branch(source, call)
        if b is None:
            return
        readable = source.encoded(call)
        with self.cv:
            if source.error is not None and b not in self.failed:
                self.failed[b] = f"{type(source.error).__name__}: {source.error}"
            elif source.length is not None and not self.ended[b]:
                self.length[b], self.ended[b] = source.length, True  # (length first, as in record)
            elif readable <= self.counts[b]:
                return  # (nothing new: the clocks go on)
            self.counts[b] = max(self.counts[b], readable)
            self.progressed = time.monotonic()
            self.cv.notify_all()

    def cancel(self) -> None:
        """Stop waiting: a staircase waiting on this feed raises at once (its consumer has gone)."""
        with self.cv:
            self.cancelled = True
            self.cv.notify_all()

    def _pump(self, stream: BranchStream) -> None:
        why = "its worker call stopped before the branch finished"
        try:
            for event in stream:
                self.record(stream, event.call, event.finish_reason is not None)
        except BaseException as e:  # noqa: BLE001 - reported as the branches' failure
            why = f"{type(e).__name__}: {e}"
        self.end(stream, why)

    def join(self) -> None:
        for thread in self.threads:
            thread.join()

    def available(self, branch: int) -> int:
        stream, j = self.where[branch]
        return stream.encoded(j)

    def live(self, branch: int) -> bool:
        return not self.ended[branch] and branch not in self.failed

    def settled(self, branch: int) -> bool:
        """Failed, or ended with every token's KV in place: nothing more will come from it."""
        return branch in self.failed or (self.ended[branch] and self.available(branch) >= self.length[branch])

    def wait(self, ready, idle_s: float | None = None, queued_s: float | None = None) -> None:
        """Until ready() (called under the lock, re-checked on each token). UnavailableError once no branch
        has made progress for `idle_s` (before any has: for `queued_s`; None: no limit); StoppedError on
        `cancel`."""
        with self.cv:
            while not (self.cancelled or ready()):
                limit, since = (queued_s, self.started) if self.progressed is None else (idle_s, self.progressed)
                left = None if limit is None else since + limit - time.monotonic()
                if left is not None and left <= 0:
                    what = "no branch started" if self.progressed is None else "no branch made progress"
                    raise UnavailableError(f"staircase: {what} for {limit:g} s")
                self.cv.wait(left)
            if self.cancelled:
                raise StoppedError("staircase: cancelled (its consumer has gone)")

    def read(self, branch: int, start: int, end: int) -> tuple[list[int], torch.Tensor | None, int] | None:
        """Tokens [start, end) of the branch message, their KV and the position the first was encoded at; None
        if they can no longer be read (a call that failed just now stored nothing), and the branch is failed
        from here on. Read once, when a round takes them in: the call may end at any moment after."""
        stream, j = self.where[branch]
        try:
            tokens, kv = stream.partial_kv(j, start, end)
        except BraidError as e:
            with self.cv:
                self.failed.setdefault(branch, str(e))
            return None
        return tokens, kv, stream.offsets[j] + start


def staircase(engine: Engine, feed: BranchFeed, prompt: Tokens, prefix: Sequence[str] = (),
              schedule: StaircaseSchedule = StaircaseSchedule(), variant: Variant = Variant.REPREFILL,
              mode: SynthesisMode = SynthesisMode(), sampling: SamplingParams = SamplingParams(),
              idle_s: float | None = 120.0, queued_s: float | None = None,
              result: StaircaseResult | None = None) -> Iterator[TokenEvent | RoundTaken]:
    """Yields each round's RoundTaken, then its answer tokens; `result` collects the whole run. `mode`: text
    (placement None) or KV re-encoded to its placement (append always places chunks one after another, the
    positions text would give them); `idle_s`: fail (UNAVAILABLE) once no branch has made progress for this
    long, `queued_s`: before any has (None: no limit)."""
    result = result if result is not None else StaircaseResult()
    m = len(feed)
    quorum = schedule.quorum(m)
    prompt_ids = engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    taken = [0] * m
    held: list[str] = []  # the chunks taken in, kept from eviction between rounds, freed at the end
    # the append variant's growing context: parents with their offsets (None: where stored), where it ends, and
    # which branch each imported chunk came from (the mapper calibrates every chunk, each round)
    parents, offsets = list(prefix), [None] * len(prefix)
    end = max((engine.message(p).end for p in prefix), default=0)
    chunk_branch: dict[str, int] = {}
    slots: dict[int, str | list[int]] = {}  # re-prefill: each branch's tokens so far (text) or their message (KV)

    def target(j: int) -> int:
        """How far branch j can be taken in now: all of it once settled, else its last whole chunk."""
        if j in feed.failed:
            return taken[j]
        return feed.length[j] if feed.settled(j) else max(taken[j], schedule.boundary(feed.available(j)))

    stream = None
    try:
        round_ = 0
        while len(result.answer) < sampling.max_tokens:
            if round_ == 0:
                feed.wait(lambda: all(feed.settled(j) for j in range(m)) or (
                    sum(1 for j in range(m) if target(j) > 0 or feed.settled(j)) >= quorum
                    and any(target(j) > 0 for j in range(m))), idle_s, queued_s)
                if not any(target(j) > 0 for j in range(m)):
                    raise UnavailableError(f"staircase: every branch failed "
                                           f"({'; '.join(sorted(set(feed.failed.values())))})")
            else:
                feed.wait(lambda: all(target(j) > taken[j] or feed.settled(j) for j in range(m)), idle_s, queued_s)
                if len(feed.failed) == m:
                    raise UnavailableError(f"staircase: every branch failed mid-answer "
                                           f"({'; '.join(sorted(set(feed.failed.values())))})")
            new, read = {}, {}  # branch -> (from, to) taken in this round, and what was read of it
            for j in range(m):
                b = target(j)
                got = feed.read(j, 0 if variant is Variant.REPREFILL else taken[j], b) if b > taken[j] else None
                if got is not None:  # (re-prefill reads each branch whole so far; append only what is new)
                    new[j], read[j] = (taken[j], b), got
            result.failed.update(feed.failed)
            seen = RoundTaken(round_, new)
            result.rounds.append(seen)
            yield seen
            for j, (_, b) in new.items():
                taken[j] = b
            budget = min(schedule.aggregator_chunk(round_), sampling.max_tokens - len(result.answer))
            params = dataclasses.replace(sampling, max_tokens=budget)
            header = prompt_ids + result.answer  # (re-encoded each round)
            if variant is Variant.REPREFILL:
                stream = _reprefill_round(engine, read, slots, header, prefix, mode, params, held)
            else:
                stream, end = _append_round(engine, read, new, header, parents, offsets, end, chunk_branch, taken,
                                            m, mode, params, held)
            finished = False
            for event in stream:
                result.answer.append(event.token_id)
                finished = event.finish_reason == "stop"
                if event.finish_reason == "length" and len(result.answer) < sampling.max_tokens:
                    event = dataclasses.replace(event, finish_reason=None, message_id=None)  # (a round ends)
                yield event
            answer_id, stream = stream.ids[0], None
            result.message_ids.append(answer_id)
            if len(result.message_ids) > 1:  # only the last round's message is the answer
                engine.free(result.message_ids[-2])
            if finished:
                break
            round_ += 1
    finally:
        if stream is not None:  # stopped mid-round (an error, or the consumer left): the call leaves the batch
            stream.close()      # and unpins what it used before anything here is freed
            engine.discard(stream.ids or ())  # (it had ended and stored its message, never handed out: it goes)
        keep = set(result.message_ids[-1:])
        engine.discard([mid for mid in held if mid not in keep])
        engine.release(held)  # (the imported chunks' holds; releasing what was never held is a no-op)


def _import(engine: Engine, chunk: tuple[list[int], torch.Tensor, int], held: list[str]) -> str:
    """A chunk read from a branch (BranchFeed.read) as a message, kept from eviction between rounds (freed, and
    released, at the end)."""
    tokens, kv, at = chunk
    mid = engine.import_message(tokens, kv.to(engine.lm.dtype), at, engine.fingerprint,
                                unrecorded="the worker's context its branch was decoded after (a staircase chunk)")
    engine.hold([mid])
    held.append(mid)
    return mid


def _reprefill_round(engine, read, slots, header, prefix, mode: SynthesisMode, params, held):
    """Every branch's tokens so far in its slot, the prompt and the answer so far after them, recomputed. A
    branch that grew (`read`: each such branch whole so far) is read again whole (text) or imported again whole
    (KV); one that failed keeps what was taken from it."""
    for j, chunk in read.items():
        if mode.text:
            slots[j] = chunk[0]
        else:
            if j in slots:
                held.remove(slots[j])
                engine.release([slots[j]])
                engine.free(slots[j])
            slots[j] = _import(engine, chunk, held)
    return synthesis_stream(engine, [slots[j] for j in sorted(slots)], header, prefix, mode, params)


def _append_round(engine, read, new, header, parents, offsets, end, chunk_branch, taken, m, mode: SynthesisMode,
                  params, held):
    """The new chunks one after another after the chunks so far (KV: each imported and re-rotated there, its
    boundary tokens refreshed when the mode says so; text: prefilled there as one message), then the prompt and
    the answer so far; the chunks before are reused as they are. The mapper sees each chunk with its branch's
    length so far (`taken`), the nearest this round knows of the whole branch's length it was trained with."""
    at = end
    if mode.text:
        tokens = [t for j in sorted(new) for t in read[j][0]]
        if tokens:
            mid, = engine.prefill([PrefillCall(tokens, parents=list(parents), offsets=list(offsets), new_offset=at)])
            engine.hold([mid])
            held.append(mid)
            parents.append(mid)
            offsets.append(at)
            at += len(tokens)
    else:
        chunks, starts = [], []
        for j, (a, b) in sorted(new.items()):
            chunks.append((_import(engine, read[j], held), j))
            starts.append(at)
            at += b - a
        parts = [(mid, start, k) for k, ((mid, _), start) in enumerate(zip(chunks, starts))]
        if chunks and mode.refresh is not None and (mode.refresh.head or mode.refresh.tail):
            # each chunk's boundary tokens re-encoded with the chunks before it in view (refreshed runs: k None)
            parts, temporary = refresh_branches(engine, list(parents), [engine.message(c) for c, _ in chunks],
                                                starts, mode.refresh)
            engine.hold(temporary)
            held.extend(temporary)
        for mid, start, k in parts:
            parents.append(mid)
            offsets.append(start)
            if k is not None:
                chunk_branch[mid] = chunks[k][1]
    call = DecodeCall(header, parents=list(parents), offsets=list(offsets), new_offset=at, sampling=params)
    stream = decode_with_hooks(engine, call, mode.hooks, chunk_branch, m,
                               {mid: taken[j] for mid, j in chunk_branch.items()})
    return stream, at
