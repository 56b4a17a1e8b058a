"""The step loop that owns the model: every engine call, from any request, batched step by step.

Each engine call (a prefill or a decode of parallel calls) becomes one `Group`, the object that carries
it through the scheduler as nano-vllm's Sequence does. One thread runs `Scheduler.step`, which is
schedule, run, postprocess: groups are admitted while their work KV fits the budget (they wait
otherwise, first come first served), every running group contributes rows (decoding groups one per
live call, groups still encoding their messages or headers a chunk, under a per-step token budget),
and one forward encodes them all, attention staying within each group (engine.model_runner). A cancelled
group leaves at the next step; a failed one stores nothing.

Work KV on demand: a group that may grow (`Group.grows`) is admitted with blocks for what it holds now
and takes more, a block at a time, as it decodes; any other group is admitted with blocks for all it
may write. When no block is free, the newest request that may grow is preempted: its blocks go back,
and it waits at the head of the queue to encode again what it had (recompute, as vLLM's default), then
goes on sampling where it stopped. Its consumer sees nothing of this but the pause.
"""

import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from braid.engine.detokenize import Detokenizer
from braid.engine.errors import StoreFullError
from braid.engine.model_runner import GroupInput, KVPool, ModelRunner, WorkCache
from braid.engine.sampling import SamplingParams, greedy_rows, make_generator, sample_rows
from braid.engine.threads import claim

log = logging.getLogger(__name__)


@dataclass
class TokenEvent:
    call: int  # index of the call in the parallel batch
    token_id: int
    text: str  # text newly decodable with this token
    finish_reason: str | None = None  # "stop" or "length" on a call's last token
    message_id: str | None = None  # on a call's last token; stored once the whole stream has ended


@dataclass
class _Done:
    ids: list[str] | None = None  # the stored messages
    error: BaseException | None = None


class Group:
    """One engine call through the scheduler: its rows still to encode, its work cache, what it generated.

    Built by the engine after validation. `assemble(blocks)` makes its work cache (parents placed) over the
    pool blocks it gets when it is admitted; `commit(tokens, slots)` stores its messages and returns their
    ids; `release()` runs once at the end whatever happened (unpins its parents). Rows are (token, position,
    call); a decode group samples a call's next token from the logits of the call's last encoded row."""

    def __init__(self, tokens: list[list[int]], offsets: list[int], visible: torch.Tensor, message_ids: list[str],
                 params: list[SamplingParams] | None, capacity: int, assemble: Callable[..., WorkCache],
                 commit: Callable, release: Callable, eos_ids: tuple[int, ...], tokenizer, device: torch.device,
                 adapter: Callable[..., AbstractContextManager] | None = None,
                 shared: list[tuple[torch.Tensor, int]] | None = None, grows: bool = False, scratch: int = 0):
        self.tokens, self.offsets, self.params = tokens, offsets, params
        self.scratch = scratch
        self.visible, self.message_ids = visible, message_ids  # bool [calls, entries + calls]; ids once stored
        self.plain = visible.shape[0] == 1 and bool(visible.all())  # (GroupInput.plain: read once, here)
        self.capacity = capacity  # the tokens of its own blocks (its work cache less the parents read in place)
        # it may run on fewer blocks than `capacity`, taking more as it decodes, and be preempted (a decode call
        # whose work KV nobody reads while it runs: see DecodeStream.partial_kv)
        self.grows = grows and params is not None
        self.preempted = 0  # times it was preempted
        self.blocks: list[int] = []
        self.shared = shared or []  # (KV, offset) of the parents it reads in place, as SharedRuns of the pool
        self.runs: list = []  # their runs while it runs
        self._assemble, self._commit, self._release = assemble, commit, release
        self.adapter = adapter  # runs its forwards inside this context (a calibration's LoRA: synthesizer or turns)
        self.prefix: list = [None] * len(tokens)  # per call, a cached start (a Message) its tokens follow
        self.cache: WorkCache | None = None
        # Readers of the work cache from other threads (DecodeStream.partial_kv) hold `lock`; `ended` is set
        # under it before the cache's blocks are handed back, `committed` once the messages are stored.
        self.lock = threading.Lock()
        self.ended = self.committed = False
        self._done_seen = False
        self.wake: Callable[[], None] = lambda: None  # (set by the scheduler: a cancel is noticed at once)
        self.on_end: Callable[[], None] = lambda: None  # (set by the scheduler: hands its blocks back)
        self.stored_ids: list[str] | None = None  # once it has ended with its messages stored
        self.slots: list[list[int]] = [[] for _ in tokens]  # cache slot of each encoded token, per call
        self.pending: deque[tuple[int, int, int]] = deque(
            (t, off + i, c) for c, (toks, off) in enumerate(zip(tokens, offsets)) for i, t in enumerate(toks))
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False
        self.timings: dict[str, float] = {}
        self.submitted = time.perf_counter()
        self.served = 0  # steps it took part in (fairness among decoding groups)
        if params is not None:
            self.stop_ids = [set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)) for p in params]
            self.generators = [make_generator(p, device) for p in params]
            self.detok = [Detokenizer(tokenizer, p.stop) for p in params]
            self.generated = [d.tokens for d in self.detok]
            self.running = set(range(scratch, len(tokens)))

    @property
    def decoding(self) -> bool:
        """Past its headers: it feeds one sampled token per live call each step (not encoding again after a
        preemption)."""
        return (self.params is not None and self.timings.get("first_token") is not None
                and len(self.pending) <= len(self.tokens))

    def needed(self) -> int:
        """Tokens of its own blocks it must hold to run now: all but what its calls may still generate (all of
        `capacity` unless it grows)."""
        if not self.grows:
            return self.capacity
        s = self.scratch  # (scratch calls generate nothing)
        return self.capacity - sum(p.max_tokens - len(gen) for p, gen in zip(self.params[s:], self.generated[s:]))

    def new_slots(self, rows: int) -> int:
        """Slots its next `rows` pending rows claim: all but scratch calls' tokens, whose slots were claimed with
        its work cache (they come first)."""
        scratch = 0
        for _, _, c in self.pending:
            if c >= self.scratch or scratch == rows:
                break
            scratch += 1
        return rows - scratch

    def all_tokens(self, call: int) -> list[int]:
        return self.tokens[call] + (self.generated[call] if self.params is not None else [])

    # ---- called by the scheduler ----------------------------------------------------------------
    def start(self, device: torch.device, blocks: list[int]) -> None:
        begin = time.perf_counter()
        self.timings.setdefault("queued", begin - self.submitted)  # (before it first ran)
        self.blocks = blocks
        self.cache = self._assemble(blocks, self.runs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.timings["assemble"] = self.timings.get("assemble", 0.0) + time.perf_counter() - begin

    def grow(self, blocks: list[int]) -> None:
        """More blocks for the rows it writes next."""
        self.blocks += blocks
        self.cache.grow(blocks)

    def restart(self) -> None:
        """(preempted: its blocks already handed back) forget its work cache; every token it has, generated ones
        included, is encoded again when it is admitted next. What it sampled stays: it samples on from there."""
        self.cache = None
        self.slots = [[] for _ in self.tokens]
        self.pending = deque((t, off + i, c) for c, off in enumerate(self.offsets)
                             for i, t in enumerate(self.all_tokens(c)))
        self.preempted += 1

    def take(self, budget: int) -> list[tuple[int, int, int]]:
        """Up to `budget` pending rows (token, position, call) for this step; `input` then makes them its input."""
        rows = [self.pending.popleft() for _ in range(min(budget, len(self.pending)))]
        self._taken = rows
        self._base = self.cache.length  # (rows other than scratch calls' take the slots from here on, in order)
        self._logit_rows = None
        if self.params is not None:  # logits where a call's encoded tokens end, while it still generates
            last = {c: i for i, (_, _, c) in enumerate(rows)}
            unfinished = {c for _, _, c in self.pending}  # calls with rows left for later steps
            ends = sorted(i for c, i in last.items() if c in self.running and c not in unfinished)
            self._logit_calls = [rows[i][2] for i in ends]
            self._logit_rows = ends or None
        return rows

    def input(self, ids: torch.Tensor, positions: torch.Tensor, calls: torch.Tensor) -> GroupInput:
        """This step's input: the rows `take` gave, as tensors (the scheduler makes every group's in one copy)."""
        self._input = GroupInput(self.cache, self.visible, ids, positions, calls, self._logit_rows,
                                 sum(c < self.scratch for _, _, c in self._taken) if self.scratch else 0,  # (first)
                                 plain=self.plain)
        return self._input

    def advance(self, logits: torch.Tensor | None, greedy: list[int] | None = None) -> bool:
        """After the forward: record slots, sample, queue the sampled tokens. True when it is complete. `greedy`:
        the argmax of each row of `logits`, if the caller read them for the whole step at once."""
        slots = self._input.slots.tolist() if self._input.scratch_rows else range(self._base, self.cache.length)
        for (_, _, c), slot in zip(self._taken, slots):  # (no device read on a plain decode step)
            self.slots[c].append(slot)
        if self.cache.front and not (self.pending and self.pending[0][2] < self.scratch):
            # every scratch row is encoded: the blocks holding only what they read go back to the pool
            k, self.cache.front = self.cache.front // self.cache.pool.block_tokens, 0
            self.cache.pool.release(self.blocks[:k])
            self.blocks = self.blocks[k:]
        if logits is not None:
            self.timings.setdefault("first_token", time.perf_counter() - self.submitted)
            calls = self._logit_calls
            sampled = sample_rows(logits, [self.params[c] for c in calls], [self.generators[c] for c in calls],
                                  greedy)
            self.events.put([self._emit(c, token) for c, token in zip(calls, sampled)])  # one put per step
        if self.pending or (self.params is not None and self.running):
            return False
        if self.params is not None:
            self.timings["decode"] = time.perf_counter() - self.submitted - self.timings["first_token"]
        return True

    def _emit(self, c: int, token: int) -> TokenEvent:
        detok = self.detok[c]
        delta = detok.add(token)
        reason = None
        if token in self.stop_ids[c] or detok.hit_stop(delta):
            reason = "stop"
        elif len(self.generated[c]) == self.params[c].max_tokens:
            reason = "length"
        if reason is not None:
            delta += detok.flush()
            self.running.discard(c)
        position = self.offsets[c] + len(self.tokens[c]) + len(self.generated[c]) - 1
        self.pending.append((token, position, c))  # every sampled token is fed once, so it gets KV
        return TokenEvent(c - self.scratch, token, delta, reason, self.message_ids[c] if reason else None)

    def finish(self) -> None:
        """Store its messages; its parents are unpinned before the consumer hears it is done."""
        try:
            done = _Done(self._commit([self.all_tokens(c) for c in range(len(self.tokens))], self.slots))
        except BaseException as e:  # e.g. the store is full: nothing is stored
            done = _Done(error=e)
        with self.lock:
            self.ended, self.committed = True, done.error is None
        self._end(done)

    def fail(self, error: BaseException) -> None:
        with self.lock:
            self.ended = True
        self._end(_Done(error=error))

    def _end(self, done: _Done) -> None:
        """Unpin, hand the blocks back, then tell the consumer: by the time it hears, nothing is held."""
        self.stored_ids = done.ids if done.error is None else None
        try:
            self._release()
        except BaseException as e:  # pragma: no cover - the consumer must hear the end whatever happens
            log.exception("releasing a call's pins failed")
            done = _Done(error=done.error or e)
        finally:
            try:
                self.on_end()
            finally:
                self.events.put(done)

    # ---- called by the consumer ------------------------------------------------------------------
    def results(self) -> Iterator[TokenEvent]:
        """Its events as they come; returns the stored message ids (or raises the group's error)."""
        try:
            while True:
                item = self.events.get()
                if isinstance(item, _Done):
                    self._done_seen = True
                    if item.error is not None:
                        raise item.error
                    return item.ids
                yield from item  # a step's events
        finally:
            if not self._done_seen:  # a consumer that left: it leaves the batch at the next step
                self.cancelled = True
                self.wake()

    def cancel(self, timeout: float = 60.0) -> None:
        """Take it out of the batch and wait until it has ended (its parents unpinned, nothing stored)."""
        self.cancelled = True
        self.wake()
        deadline = time.monotonic() + timeout
        while not self._done_seen:
            try:
                item = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                log.warning("a cancelled call did not end within %.0f s", timeout)
                return
            self._done_seen = isinstance(item, _Done)


class Scheduler:
    """Runs every Group on one model, continuously batched. `max_batched_tokens`: rows per forward; `pool`:
    where running groups' work caches live (a group waits until enough blocks are free); `max_running`:
    groups at once (0: no cap); `mix_adapters`: base-weight groups join an adapter's forwards; `threads`: torch's
    intra-op threads in the step loop's thread (0: as torch has it; EngineConfig.cpu_threads)."""

    def __init__(self, runner: ModelRunner, max_batched_tokens: int, pool: KVPool, max_running: int = 0,
                 name: str = "engine", mix_adapters: bool = True, threads: int = 0):
        self.runner, self.pool, self.mix_adapters = runner, pool, mix_adapters
        self.max_batched_tokens = max_batched_tokens
        self.slot_bytes = pool.kv[:, :, :, 0].numel() * pool.kv.element_size()
        self.max_running = max_running
        self.waiting: deque[Group] = deque()
        self.running: list[Group] = []
        self.steps = 0  # forwards run
        self.preemptions = 0  # groups preempted (their KV dropped, encoded again later) for lack of blocks
        self.groups_stepped = 0  # groups over all forwards: / steps = the mean batch, in calls
        self.busy_s = 0.0  # time spent in steps (against wall time: how loaded the model is)
        self.rows_stepped = 0  # tokens encoded over all forwards
        self._turn = 0
        self._cv = threading.Condition()
        # The thread holds the scheduler weakly, so an engine nobody uses any more is freed with its model and
        # KV pool, and the thread ends.
        claimed = threading.Event()  # (its threads are set before this returns: engine.threads)
        self._thread = threading.Thread(target=_loop, args=(weakref.ref(self), self._cv, threads, claimed),
                                        name=f"braid-scheduler-{name}", daemon=True)
        self._thread.start()
        claimed.wait()

    def submit(self, group: Group) -> None:
        """Queue a group; one that could never fit the KV budget is refused here (StoreFullError)."""
        shared = sum(self.pool.blocks_for(kv.shape[3]) for kv, _ in group.shared)  # (at most: none in the pool)
        if self.pool.blocks_for(group.capacity) + shared > self.pool.blocks:
            total = self.pool.blocks * self.pool.block_tokens * self.slot_bytes
            need = group.capacity + sum(kv.shape[3] for kv, _ in group.shared)
            raise StoreFullError(
                f"this call needs {need * self.slot_bytes} bytes of work KV (context, tokens and "
                f"max_tokens), more than the engine's whole kv_budget_bytes={total}; shorten it or raise the budget")
        group.wake = self._wake
        group.on_end = lambda: self._retire(group)
        with self._cv:
            self.waiting.append(group)
            self._cv.notify()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    @property
    def load(self) -> dict[str, int]:
        return {"waiting": len(self.waiting), "running": len(self.running),
                "reserved_bytes": (self.pool.blocks - self.pool.free_blocks) * self.pool.block_tokens * self.slot_bytes}

    def _admit(self, g: Group) -> list[int] | None:
        """Its blocks: what it needs now if it grows (leaving a block per call free to decode into), else all it
        may write; None: it waits."""
        also = self.pool.blocks_to_share(g.shared)
        if g.grows:  # (the spare blocks never more than it could grow by: what fits the pool is admitted)
            spare = min(len(g.tokens), self.pool.blocks_for(g.capacity) - self.pool.blocks_for(g.needed()))
            return self.pool.allocate(g.needed(), also=also + spare)
        return self.pool.allocate(g.capacity, also=also)

    def _room(self, g: Group, rows: int, taken: list[tuple[Group, GroupInput]]) -> bool:
        """Blocks for `rows` more of g's rows. While the pool is short, the newest request that grows (by when it
        was made, g included; never one already in this step's batch) is preempted, so the oldest go on.
        False: that was g, which skips this step."""
        short = rows - g.cache.free_slots
        if short <= 0:
            return True
        while (blocks := self.pool.allocate(short)) is None:
            victim = max((v for v in self.running if v.grows and all(v is not t for t, _ in taken)),
                         key=lambda v: v.submitted, default=None)  # (g is among them, if it grows)
            if victim is None:  # (a group that holds all it may write is never short: nothing to take back)
                raise RuntimeError(f"a call needs {short} more work-KV slots and no running call can give them")
            self._preempt(victim)
            if victim is g:
                return False
        g.grow(blocks)
        return True

    def _preempt(self, g: Group) -> None:
        """Hand g's blocks and runs back and queue it first, to encode again what it had."""
        log.debug("preempting a call of %d calls: %d blocks back to the pool", len(g.tokens), len(g.blocks))
        self.running.remove(g)
        with g.lock:  # (nobody reads the work cache of a group that grows; the lock keeps that true meanwhile)
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
        start = time.perf_counter()
        batch, adapter = self.schedule()
        if batch:
            logits = self.run(batch, adapter)
            self.postprocess(batch, logits)
        self.busy_s += time.perf_counter() - start

    def schedule(self) -> tuple[list[tuple[Group, GroupInput]], Callable | None]:
        """Admit what fits, drop what was cancelled, and pick this step's rows."""
        for g in [g for g in self.running if g.cancelled]:
            g.fail(RuntimeError("cancelled"))
        with self._cv:
            waiting, self.waiting = list(self.waiting), deque()
        admitted = []
        for i, g in enumerate(waiting):
            if g.cancelled:
                g.fail(RuntimeError("cancelled"))
                continue
            blocks = None
            if not (self.max_running and len(self.running) + len(admitted) >= self.max_running):
                blocks = self._admit(g)
                if blocks is not None:  # (at once, in this thread: the next group sees what these took)
                    try:
                        for kv, off in g.shared:
                            g.runs.append(self.pool.share(kv, off))
                    except Exception as e:  # (e.g. out of device memory copying a run in): it fails alone
                        g.blocks = blocks
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
        for g, blocks in admitted:
            try:
                g.start(self.runner.lm.device, blocks)
                self.running.append(g)
            except Exception as e:
                g.fail(e)
        ready = [g for g in self.running if g.pending]
        if not ready:
            return [], None
        # One adapter per forward, adapters taking turns. Base-weight calls join an adapter's forwards where it
        # reads its weights on its own rows only (`mixes_rows`: methods.calibration.MergedLora); not where
        # forwards may run as static graphs, which swap the adapter's weights in over every row (engine.cuda_graphs):
        # there, as with any other adapter, base calls take their own turn.
        mix = self.mix_adapters and self.runner.graphs is None
        adapters = list(dict.fromkeys(g.adapter for g in ready))
        if mix and None in adapters and len(adapters) > 1 and all(getattr(a, "mixes_rows", False)
                                                                  for a in adapters if a is not None):
            adapters.remove(None)  # base calls join every adapter's forwards
        adapter = adapters[self._turn % len(adapters)]
        self._turn += 1
        joins = mix and getattr(adapter, "mixes_rows", False)
        ready = [g for g in ready if g.adapter == adapter or (joins and g.adapter is None)]
        ready.sort(key=lambda g: (not g.decoding, g.served if g.decoding else 0))  # decodes first, fairly
        budget, batch = self.max_batched_tokens, []
        for g in ready:
            if budget <= 0:
                break
            if g.cache is None or not self._room(g, g.new_slots(min(budget, len(g.pending))), batch):
                continue  # (preempted in this loop)
            rows = g.take(budget)
            budget -= len(rows)
            batch.append((g, rows))
        batch = _inputs(batch, self.runner.lm.device)
        if not any(g.adapter == adapter for g, _ in batch):  # (its calls were preempted or out of budget)
            adapter = None
        elif adapter is not None:  # (the adapter's calls together: its rows are then a run or two of the forward's)
            batch.sort(key=lambda b: b[0].adapter != adapter)
        return batch, adapter

    def run(self, batch: list[tuple[Group, GroupInput]], adapter) -> list[torch.Tensor | None]:
        self.steps += 1
        self.groups_stepped += len(batch)
        self.rows_stepped += sum(len(inp.input_ids) for _, inp in batch)
        try:
            with _adapted(adapter, batch):
                # (a static forward has no scratch rows, so the adapter, if any, is swapped in over every row)
                return self.runner.step([inp for _, inp in batch], weights=adapter)
        except Exception as e:  # a failed forward fails its groups; nothing of theirs is stored
            log.exception("forward failed for %d group(s)", len(batch))
            for g, _ in batch:
                g.fail(e)
            return []

    def postprocess(self, batch: list[tuple[Group, GroupInput]], logits: list[torch.Tensor | None]) -> None:
        try:
            greedy = greedy_rows(logits)
        except Exception:  # (e.g. out of memory for the step's logits): each group samples its own, failing alone
            log.exception("reading the step's greedy tokens at once failed; sampling group by group")
            greedy = [None] * len(logits)
        for (g, _), lg, top in zip(batch, logits, greedy):
            g.served += 1
            try:
                done = g.advance(lg, top)
            except Exception as e:
                g.fail(e)
                continue
            if done:  # (stored, and `ended` set, before its blocks can go to another call)
                g.finish()

    def _retire(self, g: Group) -> None:
        """(Group.on_end, in this thread) out of the batch, its blocks back to the pool."""
        if g in self.running:
            self.running.remove(g)
        if g.blocks:
            self.pool.release(g.blocks)
            g.blocks = []
        for run in g.runs:
            self.pool.unshare(run)
        g.runs = []


def _inputs(taken: list[tuple[Group, list[tuple[int, int, int]]]], device) -> list[tuple[Group, GroupInput]]:
    """Each group's rows (token, position, call) as its GroupInput: one tensor for the whole step, copied to the
    device once, each group's input views of it (not a few small tensors per group)."""
    if not taken:
        return []
    flat = torch.tensor([row for _, rows in taken for row in rows], dtype=torch.long).T.contiguous().to(device)
    return [(g, g.input(*part.unbind(0))) for (g, _), part in zip(taken, flat.split([len(r) for _, r in taken], 1))]


def _adapted(adapter, batch: list[tuple[Group, GroupInput]]) -> AbstractContextManager:
    """The adapter's context for one forward: over every row, or, when base-weight rows are among them (other
    calls', or scratch calls' of its own), over its own calls' rows only: `adapter(rows=bool [rows])`."""
    if adapter is None:
        return nullcontext()
    if all(g.adapter == adapter and not g.scratch for g, _ in batch):
        return adapter()
    rows = torch.cat([inp.call_of_row >= g.scratch if g.adapter == adapter
                      else torch.zeros_like(inp.call_of_row, dtype=torch.bool) for g, inp in batch])
    return adapter() if bool(rows.all()) else adapter(rows=rows)


def _loop(ref: "weakref.ref[Scheduler]", cv: threading.Condition, threads: int, claimed: threading.Event) -> None:
    """The scheduler's thread: step while there is work, wait (holding no reference to it) while not."""
    try:
        if threads:
            claim(threads)
    except Exception:  # pragma: no cover - (torch refused the count: forwards run on what the thread has)
        log.exception("could not set the scheduler's intra-op threads to %d", threads)
    finally:
        claimed.set()
    while True:
        with cv:
            scheduler = ref()
            if scheduler is None:
                return
            idle = not scheduler.waiting and not scheduler.running
            del scheduler
            if idle:
                cv.wait(timeout=1.0)
                continue
        scheduler = ref()
        if scheduler is None:
            return
        try:
            scheduler.step()
        except Exception:  # pragma: no cover - step() fails groups itself; this keeps the loop alive
            log.exception("scheduler step failed")
        del scheduler
