"""The step loop that owns the model: every engine request, batched step by step.

Each engine request (a prefill or a decode of parallel calls) becomes one `Request`, whose calls
(engine.call.Call) it carries from admission to completion, as nano-vllm's Sequence does. One thread runs
`Scheduler.step`, which is schedule, run, postprocess: requests are admitted while their work KV fits the
budget (they wait otherwise, first come first served), every running request contributes rows (decoding
ones one per live call, ones still encoding their messages or headers a chunk, under a per-step token
budget), and one forward encodes them all, attention staying within each request (engine.model_runner).
A cancelled request leaves at the next step; a failed one stores nothing. Calls that name an adapter run on
it: one adapter per forward, adapters taking turns (base-weight rows may join an adapter's forwards).

Work KV on demand: a request that may grow (`Request.grows`) is admitted with blocks for what it holds now
and takes more, a block at a time, as it decodes; any other request is admitted with blocks for all it
may write. When no block is free, the newest request that may grow is preempted: its blocks go back,
and it waits at the head of the queue to encode again what it had (recompute, as vLLM's default), then
goes on sampling where it stopped. Its consumer sees nothing of this but the pause.

Every sampled token is fed back as a row (it gets KV), queued when its step is launched, its id still on the device
(Request.feed). Step by step, the step's tokens are read before the next is scheduled. With `overlap`, the next step is
built and launched first, its fed rows reading their ids on the device, and the tokens are read while it runs; a call
that stopped on one of them has its next draw discarded. A request with rows in a launched step is never preempted: a
step that may have to preempt waits for the one in flight.
"""

import atexit
import enum
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from itertools import chain
from typing import Protocol

import torch

from braid.engine.call import Adapter, Call, CallStatus, TokenEvent
from braid.engine.errors import StepFailedError, StoreFullError
from braid.engine.host import to_device
from braid.engine.kv_cache import KVPool, WorkCache
from braid.engine.model_runner import ModelRunner, RequestInput
from braid.engine.sampling import Picked, SamplingParams, pick
from braid.engine.store import DenseKV
from braid.engine.threads import claim

log = logging.getLogger(__name__)


@dataclass
class _Done:
    ids: list[str] | None = None  # the stored messages
    error: BaseException | None = None


@dataclass(eq=False)
class Take:
    """A request's part of one step, from `Request.take` to `Request.advance`: its rows, the calls that sample from
    their logits (in the order of their logit rows), and its input once built. With overlap two are out at once:
    the step in flight and the one being built."""

    rows: list  # (token, position, call); a token not read yet is -1 - its index in the step before's picks
    logit_calls: list[int]
    logit_rows: list[int] | None  # (RequestInput.logit_rows)
    input: RequestInput | None = None


@dataclass(eq=False)
class _Flight:
    """A launched step: its requests' takes and picks (a tensor, None: nothing sampled, or the error picking),
    their tokens on their way to the host (`picked`), or already read (`tokens`, when they could not go together)."""

    batch: list[tuple["Request", Take]]
    picks: list
    picked: Picked | None
    tokens: list | None = None


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for its blocks (first, or again after a preemption)
    RUNNING = "running"
    CANCELLED = "cancelled"  # asked to stop: it leaves at the next step (unless it ends first)
    STORED = "stored"  # ended with its messages stored
    FAILED = "failed"  # ended without storing anything (an error, or cancelled)

    @property
    def ended(self) -> bool:
        return self in (RequestStatus.STORED, RequestStatus.FAILED)


class RequestKV(Protocol):
    """The engine's side of a request's KV, which the scheduler calls from its thread: `assemble` when it is
    admitted (and again after a preemption), `commit` when every call has finished, `release` once at the end
    whatever happened."""

    def assemble(self, blocks: list[int], runs: list) -> WorkCache:
        """Its work cache over `blocks` of the pool, its parents placed (those read in place as `runs`)."""

    def commit(self, request: "Request") -> list[str]:
        """Store the messages of its calls that are stored; their ids."""

    def release(self) -> None:
        """Unpin its parents and give back what was lent to it."""


class Request:
    """One engine request through the scheduler: its calls (engine.call.Call), its work cache, its status.

    Built by the engine after validation. Rows are (token, position, call index) (a fed row's token, until read, the
    place of its pick on the device: Take.rows); a decode call samples its next
    token from the logits of its last encoded row. Prefill calls that the others read come first (`lead` of them:
    a decode request's prefill calls, or a prefill request's unstored ones): their rows are encoded before any
    other, attending a run of the cache of their own (engine.model_runner)."""

    def __init__(self, calls: list[Call], visible: torch.Tensor, capacity: int, kv: RequestKV,
                 shared: list[tuple[DenseKV, int]] | None = None, grows: bool = False, lead: int = 0):
        self.calls = calls
        self.decodes = any(c.decodes for c in calls)
        self.lead = lead  # its first calls are unstored prefill calls the others read (engine.planner.Plan.lead)
        self.decode_calls = [c for c in calls if c.decodes]
        adapters = {c.adapter for c in calls} - {None}
        self.adapter = adapters.pop() if adapters else None  # (the engine allows one besides the base weights)
        self.adapted = [c.adapter is not None for c in calls]  # per call: its rows run on the adapter
        self.visible = visible  # bool [calls, entries + calls]
        self.plain = visible.shape[0] == 1 and bool(visible.all())  # (RequestInput.plain: read once, here)
        self.capacity = capacity  # the tokens of its own blocks (its work cache less the parents read in place)
        # it may run on fewer blocks than `capacity`, taking more as it decodes, and be preempted (a decode request
        # whose work KV nobody reads while it runs: see DecodeStream.partial_kv)
        self.grows = grows and self.decodes
        self.preempted = 0  # times it was preempted
        self.blocks: list[int] = []
        self.shared = shared or []  # (KV, offset) of the parents it reads in place, as SharedRuns of the pool
        self.runs: list = []  # their runs while it runs
        self.kv = kv
        self.cache: WorkCache | None = None
        # Readers of the work cache from other threads (DecodeStream.partial_kv) hold `lock`; the status is set
        # to an ended one under it before the cache's blocks are handed back.
        self.lock = threading.RLock()  # (a consumer's cancel may run on the scheduler's thread, holding it)
        self.status = RequestStatus.WAITING
        self.heard_end = False  # (its consumer has read its end)
        self.wake: Callable[[], None] = lambda: None  # (set by the scheduler: a cancel is noticed at once)
        self.on_end: Callable[[], None] = lambda: None  # (set by the scheduler: hands its blocks back)
        self.stored_ids: list[str] | None = None  # once it has ended with its messages stored
        self.pending: deque[tuple[int, int, int]] = deque(
            (t, pos, i) for i, c in enumerate(calls) for t, pos in c.rows())
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self._timings: dict[str, float] = {}  # (`timings`: written on the scheduler's thread, read by the caller)
        self._assembling: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (CUDA: `start`'s, not read yet)
        self.submitted = time.perf_counter()
        self.served = 0  # steps it took part in (fairness among decoding requests)
        self.out = 0  # its takes not advanced yet (in this step, or in the one in flight): it cannot be preempted

    @property
    def timings(self) -> dict[str, float]:
        """Seconds, filled in as it runs: `queued`, `assemble`, `first_token`, `decode` (engine.engine.DecodeStream).
        On CUDA `assemble` is the device's time between events recorded around it, read here, on the reader's
        thread (waiting for those events alone), so that the step path never waits for the device to time it."""
        while self._assembling:
            begin, end = self._assembling.pop()
            end.synchronize()
            self._timings["assemble"] = self._timings.get("assemble", 0.0) + begin.elapsed_time(end) / 1e3
        return self._timings

    @property
    def cancelled(self) -> bool:
        return self.status is RequestStatus.CANCELLED

    def request_cancel(self) -> None:
        """From any thread: it leaves the batch at the next step, unless it has ended."""
        with self.lock:
            if not self.status.ended:
                self.status = RequestStatus.CANCELLED
        self.wake()

    @property
    def decoding(self) -> bool:
        """Past its headers: it feeds one sampled token per live call each step (not encoding again after a
        preemption)."""
        return (self.decodes and self._timings.get("first_token") is not None
                and len(self.pending) <= len(self.calls))

    def needed(self) -> int:
        """Tokens of its own blocks it must hold to run now: all but what its calls may still generate (all of
        `capacity` unless it grows)."""
        if not self.grows:
            return self.capacity
        return self.capacity - sum(c.may_generate for c in self.calls)

    def new_slots(self, rows: int) -> int:
        """Slots its next `rows` pending rows claim: all but its prefill calls' tokens, whose slots were claimed
        with its work cache (they come first)."""
        lead = 0
        for _, _, c in self.pending:
            if c >= self.lead or lead == rows:
                break
            lead += 1
        return rows - lead

    # ---- called by the scheduler ----------------------------------------------------------------
    def start(self, device: torch.device, blocks: list[int]) -> None:
        """Assemble its work cache over `blocks`, timed (`timings`) without waiting for the device."""
        begin = time.perf_counter()
        self._timings.setdefault("queued", begin - self.submitted)  # (before it first ran)
        self.blocks = blocks
        if device.type == "cuda":  # (the device's time, read when `timings` is)
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
            self.cache = self.kv.assemble(blocks, self.runs)
            events[1].record()
            self._assembling.append(events)
        else:
            self.cache = self.kv.assemble(blocks, self.runs)
            self._timings["assemble"] = self._timings.get("assemble", 0.0) + time.perf_counter() - begin
        with self.lock:
            if self.status is RequestStatus.WAITING:
                self.status = RequestStatus.RUNNING

    def grow(self, blocks: list[int]) -> None:
        """More blocks for the rows it writes next."""
        self.blocks += blocks
        self.cache.grow(blocks)

    def restart(self) -> None:
        """(preempted, under its lock: its blocks already handed back) forget its work cache; every token it has,
        generated ones included, is encoded again when it is admitted next. What it sampled stays: it samples on
        from there."""
        assert not self.out, "a request with rows in a step cannot be preempted"
        self.cache = None
        for c in self.calls:
            c.slots = []
        self.pending = deque((t, pos, i) for i, c in enumerate(self.calls) for t, pos in c.rows())
        self.preempted += 1
        if self.status is RequestStatus.RUNNING:  # (the scheduler holds its lock)
            self.status = RequestStatus.WAITING

    def take(self, budget: int) -> Take:
        """Up to `budget` pending rows (token, position, call) for this step; `input` then makes them its input."""
        rows = [self.pending.popleft() for _ in range(min(budget, len(self.pending)))]
        self.out += 1
        if not self.decodes:
            return Take(rows, [], None)
        last = {c: i for i, (_, _, c) in enumerate(rows)}  # logits where a call's encoded tokens end, while it samples
        unfinished = {c for _, _, c in self.pending}  # calls with rows left for later steps
        ends = sorted(i for c, i in last.items() if self.calls[c].samples_next and c not in unfinished)
        return Take(rows, [rows[i][2] for i in ends], ends or None)

    def input(self, take: Take, ids: torch.Tensor, positions: torch.Tensor, calls: torch.Tensor) -> RequestInput:
        """The take's rows as tensors (the scheduler makes every request's in one copy), their slots claimed in its
        work cache: its input for the step."""
        lead_rows = sum(c < self.lead for _, _, c in take.rows) if self.lead else 0  # (they come first)
        slots = self.cache.claim(calls, self.visible.shape[1] - self.visible.shape[0], lead_rows)
        take.input = RequestInput(self.cache, self.visible, ids, positions, calls, take.logit_rows, slots,
                                  plain=self.plain)
        return take.input

    def draws(self, take: Take) -> tuple[list[SamplingParams], list[torch.Generator | None]]:
        """How the take's logit rows are sampled (one per call that samples, in order): each call's sampling params
        and generator."""
        calls = [self.calls[c] for c in take.logit_calls]
        return [c.sampling for c in calls], [c.generator for c in calls]

    def feed(self, take: Take, start: int | None, tokens: list[int] | None = None) -> None:
        """(Once the take's step is launched, before its tokens are read) queue a row for each token it samples:
        every sampled token is encoded next (it gets KV). The row's token is the pick's place among the step's
        picks on the device (`start` + i, read there by the next step's input), or `tokens[i]` when already read."""
        for i, c in enumerate(take.logit_calls):
            call = self.calls[c]
            # (a non-finite draw, -1, is fed as token 0: its call fails when advanced, never reaching the embedding)
            token = max(tokens[i], 0) if tokens is not None else -1 - (start + i)
            row = [token, call.offset + len(call.all_tokens) + len(call.fed), c]  # (after the ones not read yet)
            call.fed.append(row)
            self.pending.append(row)

    def advance(self, take: Take, sampled: list[int] | None) -> bool:
        """After the take's forward: record slots, and the tokens its calls sampled (`sampled`, one per logit row;
        None: it sampled nothing), which their fed rows now hold. True when it is complete."""
        self.out -= 1
        inp = take.input
        for (_, _, c), slot in zip(take.rows, chain(inp.slots.lead, inp.slots.own)):  # (host ranges: no device read)
            self.calls[c].slots.append(slot)
        if self.cache.front and not (self.pending and self.pending[0][2] < self.lead):
            # every prefill call's row is encoded: the blocks holding only what they read go back to the pool (a
            # step in flight that reads them runs before any later one that could write them: stream order)
            k, self.cache.front = self.cache.front // self.cache.pool.block_tokens, 0
            self.cache.pool.release(self.blocks[:k])
            self.blocks = self.blocks[k:]
        if self.lead or not self.decodes:  # (prefill calls' rows in this step: not a decode step's hot path)
            for _, _, c in take.rows:
                call = self.calls[c]
                if not call.decodes and len(call.slots) == len(call.tokens):
                    call.status = CallStatus.ENCODED
        if sampled is not None:
            self._timings.setdefault("first_token", time.perf_counter() - self.submitted)
            events = []
            for c, token in zip(take.logit_calls, sampled):
                call = self.calls[c]
                if not call.sampling_now:  # it stopped on a token read after this step was built: drawn in vain
                    continue
                if token < 0:  # (sampling.draw)
                    raise ValueError(f"call {c - self.lead}: the model's logits are not finite (NaN or inf); "
                                     "nothing can be sampled from them")
                call.fed.popleft()[0] = token
                events.append(call.sampled(token, c - self.lead))
                if not call.sampling_now:  # (it stopped) a row fed a token drawn after this one is never encoded
                    for later in call.fed:
                        self._drop(later)
                    call.fed.clear()
            self.events.put(events)  # one put per step
        if self.pending or self.out or any(c.sampling_now for c in self.decode_calls):
            return False
        if self.decodes:
            self._timings["decode"] = time.perf_counter() - self.submitted - self._timings["first_token"]
        return True

    def _drop(self, row: list) -> None:
        """Take a pending row out (it is still pending: one step is in flight at most, so the only row fed after the
        token read now was fed by the step just launched, after its take)."""
        for i, r in enumerate(self.pending):
            if r is row:
                del self.pending[i]
                return
        raise RuntimeError("a row fed a token drawn in vain was already taken")

    def finish(self) -> None:
        """Store its messages; its parents are unpinned before the consumer hears it is done."""
        try:
            done = _Done(self.kv.commit(self))
        except BaseException as e:  # e.g. the store is full: nothing is stored
            done = _Done(error=e)
        with self.lock:
            self.status = RequestStatus.STORED if done.error is None else RequestStatus.FAILED
        self._end(done)

    def fail(self, error: BaseException) -> None:
        with self.lock:
            self.status = RequestStatus.FAILED
        self._end(_Done(error=error))

    def _end(self, done: _Done) -> None:
        """Unpin, hand the blocks back, then tell the consumer: by the time it hears, nothing is held."""
        self.stored_ids = done.ids if done.error is None else None
        try:
            self.kv.release()
        except BaseException as e:  # pragma: no cover - the consumer must hear the end whatever happens
            log.exception("releasing a request's pins failed")
            done = _Done(error=done.error or e)
        finally:
            try:
                self.on_end()
            finally:
                self.events.put(done)

    # ---- called by the consumer ------------------------------------------------------------------
    def results(self) -> Iterator[TokenEvent]:
        """Its events as they come; returns the stored message ids (or raises the request's error)."""
        try:
            while True:
                item = self.events.get()
                if isinstance(item, _Done):
                    self.heard_end = True
                    if item.error is not None:
                        raise item.error
                    return item.ids
                yield from item  # a step's events
        finally:
            if not self.heard_end:  # a consumer that left: it leaves the batch at the next step
                self.request_cancel()

    def cancel(self, timeout: float = 60.0) -> None:
        """Take it out of the batch and wait until it has ended (its parents unpinned, nothing stored)."""
        self.request_cancel()
        deadline = time.monotonic() + timeout
        while not self.heard_end:
            try:
                item = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                log.warning("a cancelled request did not end within %.0f s", timeout)
                return
            self.heard_end = isinstance(item, _Done)


class Scheduler:
    """Runs every Request on one model, continuously batched. `max_batched_tokens`: rows per forward; `pool`:
    where running requests' work caches live (a request waits until enough blocks are free); `max_running`:
    requests at once (0: no cap); `adapters`: the adapters calls may name, by id (the engine's registry, read at
    each step); `mix_adapters`: base-weight requests join an adapter's forwards; `threads`: torch's intra-op threads
    in the step loop's thread (0: as torch has it; EngineConfig.cpu_threads); `overlap`: build and launch each step
    before reading the tokens of the one before, which the device is still running (EngineConfig.overlap)."""

    def __init__(self, runner: ModelRunner, max_batched_tokens: int, pool: KVPool, max_running: int = 0,
                 name: str = "engine", mix_adapters: bool = True, threads: int = 0,
                 adapters: dict[str, Adapter] | None = None, overlap: bool = False):
        self.runner, self.pool, self.mix_adapters, self.overlap = runner, pool, mix_adapters, overlap
        self._flight: _Flight | None = None  # the launched step whose tokens are not read yet
        self.adapters = adapters if adapters is not None else {}
        self.max_batched_tokens = max_batched_tokens
        self.slot_bytes = pool.slot_bytes
        self.max_running = max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.steps = 0  # forwards run
        self.preemptions = 0  # requests preempted (their KV dropped, encoded again later) for lack of blocks
        self.requests_stepped = 0  # requests over all forwards: / steps = the mean batch, in calls
        self.busy_s = 0.0  # time spent in steps (against wall time: how loaded the model is)
        self.rows_stepped = 0  # tokens encoded over all forwards
        self.discarded = 0  # draws discarded: made for a call that had stopped on a token not read yet (overlap)
        self._turn = 0
        self._cv = threading.Condition()
        # The thread holds the scheduler weakly, so an engine nobody uses any more is freed with its model and
        # KV pool, and the thread ends.
        claimed = threading.Event()  # (its threads are set before this returns: engine.threads)
        self._thread = threading.Thread(target=_loop, args=(weakref.ref(self), self._cv, threads, claimed),
                                        name=f"braid-scheduler-{name}", daemon=True)
        self._thread.start()
        with _LOOPS_LOCK:  # (engines may be built on several threads at once)
            _LOOPS[:] = [(t, cv) for t, cv in _LOOPS if t.is_alive()] + [(self._thread, self._cv)]
        claimed.wait()

    def submit(self, request: Request) -> None:
        """Queue a request; one that could never fit the KV budget is refused here (StoreFullError)."""
        shared = sum(self.pool.blocks_for(kv.num_tokens) for kv, _ in request.shared)  # (at most: none in the pool)
        if self.pool.blocks_for(request.capacity) + shared > self.pool.work_blocks:
            total = self.pool.work_blocks * self.pool.block_tokens * self.slot_bytes
            need = request.capacity + sum(kv.num_tokens for kv, _ in request.shared)
            raise StoreFullError(
                f"this call needs {need * self.slot_bytes} bytes of work KV (context, tokens and "
                f"max_tokens), more than the engine's whole kv_budget_bytes={total}; shorten it or raise the budget")
        request.wake = self._wake
        request.on_end = lambda: self._retire(request)
        with self._cv:
            self.waiting.append(request)
            self._cv.notify()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    @property
    def load(self) -> dict[str, int]:
        return {"waiting": len(self.waiting), "running": len(self.running),
                "reserved_bytes": len(self.pool.in_use) * self.pool.block_tokens * self.slot_bytes}

    def _admit(self, g: Request) -> list[int] | None:
        """Its blocks: what it needs now if it grows (leaving a block per call free to decode into), else all it
        may write; None: it waits."""
        also = self.pool.blocks_to_share(g.shared)
        if g.grows:  # (the spare blocks never more than it could grow by: what fits the pool is admitted)
            spare = min(len(g.calls), self.pool.blocks_for(g.capacity) - self.pool.blocks_for(g.needed()))
            return self.pool.allocate(g.needed(), also=also + spare)
        return self.pool.allocate(g.capacity, also=also)

    def _room(self, g: Request, rows: int) -> bool:
        """Blocks for `rows` more of g's rows. While the pool is short, the newest request that grows (by when it
        was made, g included; never one with rows in this step or the one in flight) is preempted, so the oldest
        go on. False: that was g, or only a request in flight could give them; g skips this step."""
        short = rows - g.cache.free_slots
        if short <= 0:
            return True
        while (blocks := self.pool.allocate(short)) is None:
            victim = max((v for v in self.running if v.grows and not v.out),
                         key=lambda v: v.submitted, default=None)  # (g is among them, if it grows)
            if victim is None:  # (a request that holds all it may write is never short: nothing to take back)
                if self._flight is not None:  # (step checks the pool before building one while another runs)
                    return False
                raise RuntimeError(f"a call needs {short} more work-KV slots and no running call can give them")
            self._preempt(victim)
            if victim is g:
                return False
        g.grow(blocks)
        return True

    def _preempt(self, g: Request) -> None:
        """Hand g's blocks and runs back and queue it first, to encode again what it had."""
        log.debug("preempting a request of %d calls: %d blocks back to the pool", len(g.calls), len(g.blocks))
        self.running.remove(g)
        with g.lock:  # (nobody reads the work cache of a request that grows; the lock keeps that true meanwhile)
            self.pool.release(g.blocks)
            g.blocks = []
            for run in g.runs:
                self.pool.unshare(run)
            g.runs = []
            g.restart()
        self.preemptions += 1
        with self._cv:
            self.waiting.appendleft(g)

    # ---- one step: schedule, run, postprocess ---------------------------------------------------
    def step(self) -> None:
        """Schedule, run, postprocess. With `overlap`, the step before is postprocessed (its tokens read) only once
        this one is launched: the host builds a step while the device runs the one before, whose sampled tokens
        this one's rows read on the device. A step that would have to preempt waits for the one in flight."""
        start = time.perf_counter()
        try:
            if self._flight is not None and self._short():
                self._land()
            batch, adapter = self.schedule()
            flight = self.run(batch, adapter) if batch else None
            prev, self._flight = self._flight, flight
            if prev is not None:
                self.postprocess(prev)
            if not self.overlap:
                self._land()
        except Exception as e:  # a step that failed before failing its requests: they fail now, not wait forever
            log.exception("scheduler step failed")
            self._flight = None
            for g in list(self.running):
                g.fail(StepFailedError(f"the engine's step failed: {type(e).__name__}: {e}"))
        finally:
            self.busy_s += time.perf_counter() - start

    def _land(self) -> None:
        """Postprocess the step in flight, if any."""
        flight, self._flight = self._flight, None
        if flight is not None:
            self.postprocess(flight)

    def _short(self) -> bool:
        """Whether the free blocks may not cover every ready request's next rows (then a request may have to be
        preempted, which one with rows in flight cannot be: the step in flight is landed first)."""
        need = 0
        for g in self.running:
            if g.cache is not None and g.pending:
                short = g.new_slots(min(self.max_batched_tokens, len(g.pending))) - g.cache.free_slots
                need += self.pool.blocks_for(short) if short > 0 else 0
        return need > self.pool.free_blocks

    def schedule(self) -> tuple[list[tuple[Request, Take]], str | None]:
        """Admit what fits, drop what was cancelled, and pick this step's rows and adapter."""
        for g in [g for g in self.running if g.cancelled]:
            g.fail(RuntimeError("cancelled"))
        self._admit_waiting()
        ready = [g for g in self.running if g.pending]
        if not ready:
            return [], None
        adapter, ready = self._adapter_turn(ready)
        ready.sort(key=lambda g: (not g.decoding, g.served if g.decoding else 0))  # decodes first, fairly
        budget, batch = self.max_batched_tokens, []
        for g in ready:
            if budget <= 0:
                break
            if g.cache is None or not self._room(g, g.new_slots(min(budget, len(g.pending)))):
                continue  # (preempted in this loop, or waiting for the step in flight)
            take = g.take(budget)
            budget -= len(take.rows)
            batch.append((g, take))
        flight = self._flight
        _inputs(batch, self.runner.lm.device, flight.picked.tokens if flight and flight.picked else None)
        if not any(g.adapter == adapter for g, _ in batch):  # (its calls were preempted or out of budget)
            adapter = None
        elif adapter is not None:  # (the adapter's calls together: its rows are then a run or two of the forward's)
            batch.sort(key=lambda b: b[0].adapter != adapter)
        return batch, adapter

    def _admit_waiting(self) -> None:
        """Start the waiting requests, in order, while their blocks fit (and `max_running` allows)."""
        with self._cv:
            waiting, self.waiting = list(self.waiting), deque()
        admitted: list[tuple[Request, list[int]]] = []
        try:
            self._admit_in_order(waiting, admitted)
        except BaseException:  # (whatever it had not come to waits on, rather than being lost)
            with self._cv:
                self.waiting.extendleft(reversed([w for w in waiting if not w.status.ended
                                                  and all(w is not a for a, _ in admitted)]))
            raise
        finally:
            for g, blocks in admitted:
                try:
                    g.start(self.runner.lm.device, blocks)
                    self.running.append(g)
                except Exception as e:
                    g.fail(e)

    def _admit_in_order(self, waiting: list[Request], admitted: list) -> None:
        """Admit `waiting` in order into `admitted` (request, blocks) until one does not fit: it and the rest go
        back to the head of the queue."""
        for i, g in enumerate(waiting):
            if g.cancelled:
                g.fail(RuntimeError("cancelled"))
                continue
            blocks = None
            if not (self.max_running and len(self.running) + len(admitted) >= self.max_running):
                try:  # (at once, in this thread: the next request sees what these took)
                    blocks = self._admit(g)
                    if blocks is not None:
                        g.blocks = blocks
                        for kv, off in g.shared:
                            g.runs.append(self.pool.share(kv, off))
                except Exception as e:  # (e.g. out of device memory copying a run in): it fails alone
                    g.fail(e)  # (its blocks and runs go back with it)
                    continue
            if blocks is None:  # first come, first served: the rest wait behind it
                rest = waiting[i:]
                for w in rest[1:]:
                    if w.cancelled:
                        w.fail(RuntimeError("cancelled"))
                with self._cv:
                    self.waiting.extendleft(reversed([g] + [w for w in rest[1:] if not w.cancelled]))
                break
            admitted.append((g, blocks))

    def _adapter_turn(self, ready: list[Request]) -> tuple[str | None, list[Request]]:
        """This forward's adapter (adapters take turns, one per forward) and the requests that may join it.
        Base-weight requests join an adapter's forwards where it reads its weights on its own rows only
        (`mixes_rows`); not where forwards may run as static graphs, which swap the adapter's weights in over
        every row (engine.cuda_graphs): there, as with any other adapter, base requests take their own turn."""
        mix = self.mix_adapters and self.runner.graphs is None
        ids = list(dict.fromkeys(g.adapter for g in ready))
        if mix and None in ids and len(ids) > 1 and all(_mixes_rows(self.adapters[a]) for a in ids if a is not None):
            ids.remove(None)  # base requests join every adapter's forwards
        adapter = ids[self._turn % len(ids)]
        self._turn += 1
        joins = mix and adapter is not None and _mixes_rows(self.adapters[adapter])
        return adapter, [g for g in ready if g.adapter == adapter or (joins and g.adapter is None)]

    def run(self, batch: list[tuple[Request, Take]], adapter: str | None) -> _Flight | None:
        """Launch the forward and the picks of its tokens (on the device; nothing read) and feed each pick to the
        row that encodes it next. None: the forward failed, and so did its requests."""
        self.steps += 1
        self.requests_stepped += len(batch)
        self.rows_stepped += sum(len(take.rows) for _, take in batch)
        weights = self.adapters[adapter] if adapter is not None else None
        try:
            with _adapted(weights, adapter, batch):
                # (a static forward has no prefill calls' rows, so the adapter, if any, is in place over every row)
                logits = self.runner.step([take.input for _, take in batch], weights=weights)
        except Exception as e:  # a failed forward fails its requests; nothing of theirs is stored
            log.exception("forward failed for %d request(s)", len(batch))
            for g, _ in batch:
                g.fail(e)
            return None
        picks: list = []  # each request's tokens on the device (or the error picking them, which fails it alone)
        for (g, take), lg in zip(batch, logits):
            try:
                picks.append(None if lg is None else pick(lg, *g.draws(take)))
            except Exception as e:
                picks.append(e)
        flight = _Flight(batch, picks, None)
        try:  # (together: one copy to the host, and the next step's rows read them there)
            flight.picked = Picked([None if isinstance(p, Exception) else p for p in picks])
        except Exception:  # (e.g. out of memory joining them): each request's read alone, now
            log.exception("joining the step's tokens failed; reading them request by request")
            flight.tokens = [p if isinstance(p, Exception) else _read_alone(p) for p in picks]
        for i, (g, take) in enumerate(batch):
            p = picks[i] if flight.tokens is None else flight.tokens[i]
            if p is not None and not isinstance(p, Exception):
                g.feed(take, flight.picked.starts[i] if flight.tokens is None else None,
                       p if flight.tokens is not None else None)
        return flight

    def postprocess(self, flight: _Flight) -> None:
        """Read the flight's tokens (the step's one device read) and advance its requests; those complete are
        stored."""
        tokens = flight.tokens
        if tokens is None and flight.picked is not None:
            try:  # (a sampled token is drawn once, however it is read)
                tokens = flight.picked.read()
            except Exception:  # each request's read alone, failing alone
                log.exception("reading the step's tokens at once failed; reading them request by request")
                tokens = [p if isinstance(p, Exception) else _read_alone(p) for p in flight.picks]
        for i, ((g, take), p) in enumerate(zip(flight.batch, flight.picks)):
            if g.status.ended:  # (failed or cancelled while its step ran)
                continue
            g.served += 1
            try:
                if isinstance(p, Exception):
                    raise p
                if isinstance(tokens[i], Exception):
                    raise tokens[i]
                if tokens[i] is not None:
                    self.discarded += sum(not g.calls[c].sampling_now for c in take.logit_calls)
                done = g.advance(take, tokens[i])
            except Exception as e:
                g.fail(e)
                continue
            if done:  # (stored, and its status ended, before its blocks can go to another call)
                g.finish()

    def _retire(self, g: Request) -> None:
        """(Request.on_end, in this thread) out of the batch, its blocks back to the pool."""
        if g in self.running:
            self.running.remove(g)
        if g.blocks:
            self.pool.release(g.blocks)
            g.blocks = []
        for run in g.runs:
            self.pool.unshare(run)
        g.runs = []


def _inputs(batch: list[tuple[Request, Take]], device, picked: torch.Tensor | None) -> None:
    """Each request's rows (token, position, call) as its input: one tensor for the whole step, copied to the device
    once, each request's input views of it (not a few small tensors per request). A row whose token is not read
    yet reads it from `picked`, the step in flight's picks on the device."""
    if not batch:
        return
    flat = to_device(torch.tensor([row for _, take in batch for row in take.rows]).T.contiguous(), device)
    if picked is not None:  # ids < 0: -1 - a pick's place (a non-finite draw, -1, reads token 0: its call fails)
        ids = flat[0]
        flat[0] = torch.where(ids < 0, picked.clamp_min(0)[(-1 - ids).clamp(0, picked.numel() - 1)], ids)
    for (g, take), part in zip(batch, flat.split([len(take.rows) for _, take in batch], 1)):
        g.input(take, *part.unbind(0))


def _read_alone(p: torch.Tensor | None) -> list[int] | Exception | None:
    """One request's picks read on their own (when the step's could not be read together), or the error."""
    try:
        return Picked([p]).read()[0]
    except Exception as e:
        return e


def _mixes_rows(adapter: Adapter) -> bool:
    return getattr(adapter, "mixes_rows", False)  # (an adapter that does not say cannot share its forwards)


def _adapted(weights: Adapter | None, adapter: str | None, batch: list[tuple[Request, Take]]
             ) -> AbstractContextManager:
    """The adapter's weights in place for one forward: over every row, or, when base-weight rows are among them
    (other requests', or calls of its own on the base weights), over its own calls' rows only:
    `weights(rows=bool [rows])` (built on the host: nothing read from the device)."""
    if weights is None:
        return nullcontext()
    rows = [g.adapter == adapter and g.adapted[c] for g, take in batch for _, _, c in take.rows]
    if all(rows):
        return weights()
    return weights(rows=to_device(rows, batch[0][1].input.input_ids.device, torch.bool))


# Every scheduler thread, ended at exit before the interpreter finalizes: a daemon thread still in a step then (freeing
# its tensors releases the GIL, which it may not take back once finalizing) would abort the process.
_LOOPS: list[tuple[threading.Thread, threading.Condition]] = []
_LOOPS_LOCK = threading.Lock()
_EXITING = threading.Event()


@atexit.register
def _end_loops() -> None:
    _EXITING.set()
    with _LOOPS_LOCK:
        loops = list(_LOOPS)
    for _, cv in loops:
        with cv:
            cv.notify_all()
    for thread, _ in loops:
        thread.join(timeout=30)


def _loop(ref: "weakref.ref[Scheduler]", cv: threading.Condition, threads: int, claimed: threading.Event) -> None:
    """The scheduler's thread: step while there is work, wait (holding no reference to it) while not; it ends with
    its scheduler, or at exit."""
    try:
        if threads:
            claim(threads)
    except Exception:  # pragma: no cover - (torch refused the count: forwards run on what the thread has)
        log.exception("could not set the scheduler's intra-op threads to %d", threads)
    finally:
        claimed.set()
    while not _EXITING.is_set():
        with cv:
            scheduler = ref()
            if scheduler is None:
                return
            idle = not scheduler.waiting and not scheduler.running and scheduler._flight is None
            del scheduler
            if idle:
                cv.wait(timeout=1.0)
                continue
        scheduler = ref()
        if scheduler is None:
            return
        try:
            scheduler.step()  # (a step that fails fails its requests itself)
        except Exception:  # pragma: no cover - (failing them failed too): this keeps the loop alive
            log.exception("scheduler step failed")
        del scheduler
