"""The choreography API over a message store: prefill and decode of parallel calls.

Every call is validated and planned in the caller's thread before anything runs,
then runs in the scheduler (engine.scheduler), batched with every other call in
flight. Messages are inserted into the store only when the whole call has
succeeded, so a failed call leaves the store exactly as it was.
"""

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace

import torch
from braid.engine.config import EngineConfig
from braid.engine.cuda_graphs import DecodeGraphs
from braid.engine.errors import (
    BraidError,
    ContextOverflowError,
    EmptyHeaderError,
    FingerprintMismatchError,
    InvalidOffsetError,
)
from braid.engine.model import LoadedModel, load_model
from braid.engine.model_runner import KVPool, ModelRunner, WorkCache
from braid.engine.prefix_cache import PrefixCache, content_seed
from braid.engine.sampling import SamplingParams
from braid.engine.scheduler import Group, Scheduler, TokenEvent
from braid.engine.store import Message, MessageStore, new_message_id
from braid.engine.threads import one_thread
from braid.kernels import rerotate_keys

log = logging.getLogger(__name__)
_SCRATCH = SamplingParams(max_tokens=1)  # a scratch call's place in a decode group's params: never sampled
CACHED_PREFIX = "~cached-"  # ids of the prefix cache's own messages (never given to callers)

Tokens = str | Sequence[int]


@dataclass(frozen=True)
class KVTransform:
    """The cache-mapper seam: `apply(message, kv)` maps the placed copy [L, 2, H, T, D] of each parent in `ids`
    (it may work in place: the copy is the engine's own) before a decode call attends to it. Scratch calls
    (Engine.decode_stream) read the same parents unmapped."""

    ids: frozenset[str]
    apply: Callable[[Message, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Scratch:
    """A decode call's parent that is not a stored message: scratch call `index` of the same decode_stream,
    encoded in the same forwards before the decode calls, at its own new_offset, and never stored."""

    index: int


@dataclass
class PrefillCall:
    message: Tokens
    parents: Sequence[str] = ()
    offsets: Sequence[int | None] | None = None  # None entries: directly after the previous parent
    new_offset: int | None = None  # None: directly after the last parent


@dataclass
class DecodeCall:
    header: Tokens  # non-empty: the first generated token is predicted from its last token
    parents: Sequence[str] = ()
    offsets: Sequence[int | None] | None = None
    new_offset: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class _Plan:
    entries: list[tuple[Message, int]]  # placed context: (parent, offset), deduplicated
    visible: torch.Tensor  # bool [calls, entries + calls]
    tokens: list[list[int]]  # the tokens each call encodes first (message or header)
    new_offsets: list[int]
    parents: list[tuple[str, ...]]
    parent_offsets: list[tuple[int, ...]]
    new_ids: list[str]
    seeds: list[bytes | None] = field(default_factory=list)  # (engine.prefix_cache) per call, when cacheable
    prefix: list[Message | None] = field(default_factory=list)  # a cached start of the call's tokens, reused
    scratch: int = 0  # the first calls are scratch calls: encoded, read by the others, never stored
    # With scratch calls, entries are ordered: those only scratch calls read (`scratch_only` of them), those both
    # sides read, then (after the scratch tokens' slots) those only decode calls read: each side's one run.
    scratch_only: int = 0
    scratch_at: int = 0  # the entry before which the scratch tokens' slots go
    mapped: list[bool] = field(default_factory=list)  # per entry: a decode call's copy through the transform

    @property
    def parent_ids(self) -> set[str]:
        return {m.id for m, _ in self.entries}


class DecodeStream:
    """Iterate for TokenEvents; `ids` holds the new message ids once iteration ends.

    The call runs in the scheduler from the moment it is made; iterating reads its tokens as they come.
    `timings` (seconds) fills in as it runs: `queued` (waiting for KV budget), `assemble` (placing parents
    into the work cache), `first_token` (from the call to the first sampled token), `decode` (the rest).
    """

    def __init__(self, group: Group, store: MessageStore):
        self._group, self._store = group, store
        self._events = group.results()
        self.timings = group.timings
        self.ids: list[str] | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        self.ids = yield from self._events

    def close(self) -> None:
        """Stop a stream early: it leaves the batch, its messages are not stored (unless it had already
        ended), and its parents are unpinned by the time this returns."""
        self._events.close()
        self._group.cancel()
        if self.ids is None and self._group.stored_ids is not None:  # it had ended, stored, before the close
            self.ids = self._group.stored_ids

    def interrupt(self) -> None:
        """From any thread: the call leaves the batch at the next step, and whoever iterates it sees it end
        with an error (`close` is for the thread that iterates it)."""
        self._group.cancelled = True
        self._group.wake()

    def _reused(self, call: int) -> int:
        prefix = self._group.prefix[self._group.scratch + call]
        return prefix.num_tokens if prefix is not None else 0

    def encoded(self, call: int) -> int:
        """How many of the call's tokens (header included) already have KV. It grows as the scheduler runs,
        which may be ahead of the events read so far: read it once per use. Only for a stream made with
        `readable=True` (a preempted call would have less)."""
        self._readable()
        return self._reused(call) + len(self._group.slots[self._group.scratch + call])

    def _readable(self) -> None:
        if self._group.grows and not self._group.committed:
            raise BraidError("this decode stream's work KV is not readable while it runs (it may be preempted); "
                             "make it with Engine.decode_stream(..., readable=True)")

    def offset(self, call: int) -> int:
        """Where the call's message starts (the position of its first token, a reused cached start included)."""
        return self._group.offsets[self._group.scratch + call] - self._reused(call)

    def partial_kv(self, call: int, start: int, end: int) -> tuple[list[int], torch.Tensor]:
        """Tokens [start, end) of the call's message and their KV [L, 2, H, T, D], while it decodes, or
        from the stored message once it has ended."""
        g = self._group
        with g.lock:  # (the work cache is not handed to another call while this reads it)
            if g.committed:
                msg = self._store.get(g.message_ids[g.scratch + call])
                return list(msg.token_ids[start:end]), msg.kv[:, :, :, start:end].contiguous()
            if g.ended:
                raise BraidError(f"call {call} ended without storing its message")
            if not 0 <= start <= end <= self.encoded(call):  # (encoded refuses a stream that may be preempted)
                raise BraidError(f"call {call}: tokens {start}-{end} are not encoded yet ({self.encoded(call)} are)")
            n, prefix, c = self._reused(call), g.prefix[g.scratch + call], g.scratch + call
            tokens, parts = [], []
            if start < n:  # the cached start it reused
                tokens += prefix.token_ids[start:min(end, n)]
                parts.append(prefix.kv[:, :, :, start:min(end, n)])
            if end > n:
                lo = max(start, n) - n
                slots = torch.tensor(g.slots[c][lo:end - n], dtype=torch.long, device=g.cache.index.device)
                tokens += g.all_tokens(c)[lo:end - n]
                parts.append(g.cache.gather(slots))
            return list(tokens), parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=3)


class Engine:
    """The choreography API over one model. Calls from any thread run concurrently, batched by the
    scheduler; the store is guarded by an internal lock. `lock` is for callers that need several steps
    of their own to be atomic (a session's check-then-use); the engine never takes it."""

    def __init__(self, config: EngineConfig):
        self.config = config = config.resolved()
        # (on CPU the model is loaded and the pools allocated on one thread, so that the scheduler's thread is the
        # only one with an OpenMP pool: engine.threads)
        caller_threads = torch.get_num_threads()
        with one_thread() if torch.device(config.device).type == "cpu" else nullcontext():
            self.lm = load_model(config)
            self.spec = self.lm.spec
            self.tokenizer = _SharedTokenizer(self.lm.tokenizer)
            self.fingerprint = self.lm.fingerprint
            self.store = MessageStore(config.store_budget_bytes)
            self.runner = ModelRunner(self.lm)
            self.lock = threading.RLock()
            self._store_lock = threading.Lock()
            self.prefix_cache = PrefixCache(config.prefix_block_tokens) if config.prefix_caching else None
            s = self.spec
            slot_bytes = s.num_layers * 2 * s.num_kv_heads * s.head_dim * self.lm.dtype.itemsize
            self.scheduler = Scheduler(self.runner, config.max_batched_tokens,
                                       KVPool(self.lm, max(1, _kv_budget(config, self.lm.device) // slot_bytes
                                                           // config.kv_block_tokens), config.kv_block_tokens),
                                       config.max_running_calls, name=self.fingerprint[:8],
                                       mix_adapters=config.mix_adapters,
                                       threads=_cpu_threads(config, self.lm, caller_threads))
            graphs = config.decode_graphs
            if graphs == "eager" or (graphs == "auto" and self.lm.device.type == "cuda"):
                self.runner.graphs = DecodeGraphs(self.runner, self.scheduler.pool, capture=graphs == "auto")
            self.calibration = None  # methods.calibration.Attached: the trained cache mapper and synthesizer LoRA
            if config.calibration != "none":
                from braid.methods.calibration import attach  # (it builds on methods.synthesis, which imports this)

                self.calibration = attach(self, config.calibration)
                log.info("calibration %s attached (trained on %s)", config.calibration,
                         self.calibration.calibration.base_model)
            log.info("engine ready: %s, fingerprint %s, %d positions", config.model_path, self.fingerprint,
                     self.spec.max_positions)

    # ---- messages -------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def message(self, message_id: str) -> Message:
        return self.store.get(message_id)

    def text(self, message_id: str) -> str:
        return self.tokenizer.decode(list(self.store.get(message_id).token_ids))

    def free(self, message_id: str, when_unpinned: bool = False) -> None:
        """Free a message; one a running call uses raises MessageInUseError, or with `when_unpinned` goes
        as soon as no call uses it."""
        with self._store_lock:
            self.store.free(message_id, when_unpinned)

    def hold(self, message_ids: Sequence[str]) -> list[str]:
        """Keep messages from eviction between calls, until `release(returned)` (they can still be freed)."""
        with self._store_lock:
            for mid in message_ids:
                self.store.get(mid)  # (NOT_FOUND if it is gone already)
            return self.store.hold(message_ids)

    def release(self, held: list[str]) -> None:
        with self._store_lock:
            self.store.release(held)

    def clear_prefix_cache(self) -> int:
        """Drop what the prefix cache alone keeps (messages' KV still in use stays); returns the bytes freed."""
        with self._store_lock:
            before = self.store.used_bytes
            for mid in self.store.ids():
                if mid.startswith(CACHED_PREFIX) and not self.store.pinned_count(mid):
                    self.store.free(mid)
            if self.prefix_cache is not None:
                self.prefix_cache.prune(self.store)
            return before - self.store.used_bytes

    def import_message(self, token_ids: Sequence[int], kv: torch.Tensor, offset: int, fingerprint: str,
                       parents: Sequence[str] = (), parent_offsets: Sequence[int] = (),
                       message_id: str | None = None) -> str:
        """Store a message encoded elsewhere (shipped KV, or a session's message moved from another replica).
        Checked like any parent would be; one encoded by this model's adapted weights ("<fingerprint>+<tag>")
        is stored as such, and no call takes it as a parent."""
        s = self.spec
        if fingerprint.partition("+")[0] != self.fingerprint:
            raise FingerprintMismatchError(f"shipped message was encoded by model {fingerprint}, this engine runs "
                                           f"{self.fingerprint}")
        want = (s.num_layers, 2, s.num_kv_heads, len(token_ids), s.head_dim)
        if tuple(kv.shape) != want or kv.dtype != self.lm.dtype:
            raise BraidError(f"shipped KV has shape {tuple(kv.shape)} and dtype {kv.dtype}; this engine needs "
                             f"{want} and {self.lm.dtype}")
        if not token_ids or offset < 0 or offset + len(token_ids) > s.max_positions:
            raise InvalidOffsetError(f"shipped message of {len(token_ids)} tokens at offset {offset} does not fit "
                                     f"in {s.max_positions} positions")
        if message_id is not None and message_id in self.store:
            raise BraidError(f"message id {message_id!r} already exists")
        msg = Message(message_id or new_message_id(), tuple(int(t) for t in token_ids),
                      kv.to(self.lm.device).contiguous(), offset, tuple(parents), tuple(parent_offsets), fingerprint)
        with self._store_lock:
            self.store.add([msg])
        return msg.id

    def context_kv(self, message_id: str) -> torch.Tensor:
        """What the call that encoded a message attended to before its own tokens: its parents' KV, each placed
        at the offset the call read it at, concatenated [L, 2, H, C, D] (unmapped; in the order of its parents;
        attention reads a context as a set, its positions carried by the rotated keys). For training on the
        contexts the engine really builds (braid.train.turns)."""
        with self._store_lock:
            msg = self.store.get(message_id)
            pairs = dict.fromkeys(zip(msg.parents, msg.parent_offsets))  # (deduplicated, as the call placed them)
            parents = [(self.store.get(p), o) for p, o in pairs]
        if not parents:
            s = self.spec
            return torch.empty(s.num_layers, 2, s.num_kv_heads, 0, s.head_dim, dtype=self.lm.dtype,
                               device=self.lm.device)
        return torch.cat([self._placed(p, o) for p, o in parents], dim=3)

    def view(self, message_id: str, start: int, end: int) -> str:
        """A new message over tokens [start, end) of a stored one, at their own positions, sharing its KV (no
        copy); freed like any other. Its content key is unknown, so nothing encoded after it is prefix-cached."""
        with self._store_lock:
            msg = self.store.get(message_id)
            if not 0 <= start < end <= msg.num_tokens:
                raise BraidError(f"view [{start}, {end}) of message {message_id!r} is out of range: it has "
                                 f"{msg.num_tokens} tokens")
            part = Message(new_message_id(), msg.token_ids[start:end], msg.kv[:, :, :, start:end],
                           msg.offset + start, (message_id,), (msg.offset,), msg.fingerprint)
            self.store.add([part])
        return part.id

    # ---- the choreography API -------------------------------------------------------------------
    def prefill(self, calls: Sequence[PrefillCall]) -> list[str]:
        """Encode each call's message (all in one group of forwards); each message stays contiguous. A message
        found in the prefix cache whole is not encoded again: it shares the cached KV."""
        group, ready = self._submit([c.message for c in calls], calls, None, None, None, self.fingerprint)
        encoded = []
        if group is not None:
            events = group.results()
            try:
                while True:
                    next(events)
            except StopIteration as done:
                encoded = done.value
            except BaseException:  # the whole call fails: the messages found in the cache go too
                self._drop(list(ready.values()))
                raise
        encoded = iter(encoded)
        return [ready[c] if c in ready else next(encoded) for c in range(len(calls))]

    def decode(self, calls: Sequence[DecodeCall], on_token: Callable[[TokenEvent], None] | None = None) -> list[str]:
        stream = self.decode_stream(calls)
        for event in stream:
            if on_token is not None:
                on_token(event)
        return stream.ids

    def decode_stream(self, calls: Sequence[DecodeCall], transform: KVTransform | None = None,
                      adapter: Callable[..., AbstractContextManager] | None = None,
                      tag: str | None = None, readable: bool = False,
                      scratch: Sequence[PrefillCall] = ()) -> DecodeStream:
        """Decode all calls together, one row per call per step, masked so calls never see each other.

        Validation happens here, before the first event; `transform` and `adapter` are the
        seams for a cache mapper and a LoRA adapter (see methods.synthesis). `tag`: the new messages were
        encoded by adapted weights; they are stored as encoded by "<fingerprint>+<tag>", which the base
        model refuses as a parent. `readable`: its KV is read while it decodes (`DecodeStream.partial_kv`),
        so it holds work KV for all its `max_tokens` from the start and is never preempted; otherwise (with
        `kv_on_demand`) it may take its blocks as it decodes.
        `scratch`: prefill calls encoded in the same forwards, before the decode calls' headers, that a decode
        call reads by naming `Scratch(i)` among its parents (at scratch call i's new_offset): no call of their
        own, no message stored, and base weights whatever the adapter (methods.synthesis's boundary refresh, in
        the synthesizer's own prefill). They read parents unmapped, and count against max_parallel_calls.
        """
        fingerprint = self.fingerprint if tag is None else f"{self.fingerprint}+{tag}"
        values = [c.message for c in scratch] + [c.header for c in calls]
        params = [_SCRATCH] * len(scratch) + [c.sampling for c in calls]  # (a scratch call samples nothing)
        group, _ = self._submit(values, [*scratch, *calls], params, transform, adapter, fingerprint,
                                grows=self.config.kv_on_demand and not readable, scratch=len(scratch))
        return DecodeStream(group, self.store)

    # ---- internals ------------------------------------------------------------------------------
    def _as_tokens(self, value: Tokens, what: str, call: int) -> list[int]:
        tokens = self.tokenize(value) if isinstance(value, str) else [int(t) for t in value]
        if not tokens:
            err = EmptyHeaderError if what == "header" else BraidError
            raise err(f"call {call}: {what} is empty; it must hold at least one token")
        bad = [t for t in tokens if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise BraidError(f"call {call}: token id {bad[0]} is outside the vocabulary [0, {self.spec.vocab_size})")
        return tokens

    def _submit(self, values: Sequence[Tokens], calls, params: list[SamplingParams] | None,
                transform: KVTransform | None, adapter, fingerprint: str,
                grows: bool = False, scratch: int = 0) -> tuple[Group | None, dict[int, str]]:
        """Validate and plan in the caller's thread (errors surface here), reuse what the prefix cache holds,
        pin the parents, hand the rest to the scheduler. Returns the group (None: nothing left to encode)
        and the ids of prefill calls found whole in the cache, by call index."""
        extra = [0] * len(calls) if params is None else [0] * scratch + [p.max_tokens for p in params[scratch:]]
        what = "header" if params is not None else "message"
        with self._store_lock:
            plan = self._plan(values, calls, extra, what, scratch, transform.ids if transform is not None else ())
            ready: dict[int, str] = {}
            views: list[str] = []
            # A mapped or adapted call's KV is not what the base model gives for the same content: not cached;
            # nor is a call that reads scratch calls (no stored content to key it by).
            if self.prefix_cache is not None and transform is None and adapter is None and not scratch:
                plan, ready, views, extra = self._reuse(plan, calls, extra, what, fingerprint)
            pins = self.store.pin(plan.parent_ids if plan is not None else ())

        def release():
            with self._store_lock:
                self.store.unpin(pins)
                for v in views:  # the cached prefixes lent to this call
                    self.store.free(v)

        if plan is None:
            release()
            return None, ready
        own = sum(map(len, plan.tokens)) + sum(extra)
        in_place = self._in_place(plan, transform, own)
        shared = [(m.kv, off) for (m, off), yes in zip(plan.entries, in_place) if yes]
        capacity = own + sum(m.num_tokens for (m, _), yes in zip(plan.entries, in_place) if not yes)
        try:
            group = Group(plan.tokens, plan.new_offsets, plan.visible, plan.new_ids, params, capacity,
                          lambda blocks, runs: self._assemble(plan, sum(extra), transform, blocks, in_place, runs),
                          lambda tokens, slots: self._commit(plan, group.cache, tokens, slots, fingerprint,
                                                             cache_prefill=params is None),
                          release, self.spec.eos_token_ids, self.tokenizer, self.lm.device, adapter, shared, grows,
                          scratch)
            group.prefix = plan.prefix or group.prefix
            self.scheduler.submit(group)
        except BaseException:
            release()
            self._drop(list(ready.values()))
            raise
        return group, ready

    def _in_place(self, plan: _Plan, transform: KVTransform | None, own_tokens: int) -> list[bool]:
        """Which of the call's parents it reads in place (runs of the KV pool, one copy for every running call
        that reads them so) rather than copying into its own blocks: those placed where they were encoded,
        untransformed and a block long at least (a run takes whole blocks). None when they are mostly copied
        anyway (a cache of the call's own blocks is read as a view each forward, where reading any parent in
        place gathers the whole cache each forward), nor when their runs would not fit the pool."""
        pool, none = self.scheduler.pool, [False] * len(plan.entries)
        if not self.config.share_parents or transform is not None:
            return none
        yes = [off == m.offset and m.num_tokens >= pool.block_tokens for m, off in plan.entries]
        shared = [m.num_tokens for (m, _), y in zip(plan.entries, yes) if y]
        copied = sum(m.num_tokens for (m, _), y in zip(plan.entries, yes) if not y)
        fits = pool.blocks_for(own_tokens + copied) + sum(map(pool.blocks_for, shared)) <= pool.blocks
        return yes if fits and sum(shared) >= copied else none

    def _drop(self, message_ids: list[str]) -> None:
        with self._store_lock:
            for mid in message_ids:
                if mid in self.store:
                    self.store.free(mid)

    def _reuse(self, plan: _Plan, calls, extra: list[int], what: str, fingerprint: str):
        """Look every call up in the prefix cache (store lock held). A prefill call found whole becomes a
        message sharing the cached KV at once; a call whose start is cached gets that start as a lent parent
        (a view, no copy) and encodes only the rest. Returns (plan of what is left or None, ready ids,
        lent view ids, max new tokens of what is left)."""
        cache, n_calls = self.prefix_cache, len(calls)
        seeds = [content_seed(fingerprint, [(self.store.get(p).content_key, off) for p, off in
                                            zip(plan.parents[c], plan.parent_offsets[c])], plan.new_offsets[c])
                 for c in range(n_calls)]
        hits = [cache.lookup(seeds[c], plan.tokens[c], len(plan.tokens[c]) - (what == "header"), self.store)
                for c in range(n_calls)]
        if not any(hits):
            plan.seeds, plan.prefix = seeds, [None] * n_calls
            return plan, {}, [], extra
        ready, views, left, prefixes = {}, [], [], []
        for c, hit in enumerate(hits):
            toks, off = plan.tokens[c], plan.new_offsets[c]
            if hit is None:
                left.append((c, calls[c], toks))
                prefixes.append(None)
                continue
            msg, n = hit
            kv = msg.kv if n == msg.num_tokens else msg.kv[:, :, :, :n]  # a view: the same memory
            self.store.touch([msg.id])
            if n == len(toks):  # a prefill found whole
                mine = Message(plan.new_ids[c], tuple(toks), kv, off, plan.parents[c], plan.parent_offsets[c],
                               msg.fingerprint, msg.content_key if n == msg.num_tokens else
                               cache.content_key(seeds[c], toks))
                self.store.add([mine])
                ready[c] = mine.id
                continue
            view = Message(f"~prefix-{new_message_id()}", tuple(toks[:n]), kv, off, (), (), msg.fingerprint)
            self.store.add([view])
            views.append(view.id)
            call = replace(calls[c], parents=[*plan.parents[c], view.id], offsets=[*plan.parent_offsets[c], off],
                           new_offset=off + n)
            left.append((c, call, toks[n:]))
            prefixes.append(view)
        if not left:
            return None, ready, views, []
        keep = [c for c, _, _ in left]
        rest = self._plan([t for _, _, t in left], [call for _, call, _ in left], [extra[c] for c in keep], what)
        rest.parents = [plan.parents[c] for c in keep]  # (what the messages record: not the lent views)
        rest.parent_offsets = [plan.parent_offsets[c] for c in keep]
        rest.new_ids = [plan.new_ids[c] for c in keep]
        rest.seeds, rest.prefix = [seeds[c] for c in keep], prefixes
        return rest, ready, views, [extra[c] for c in keep]

    def _plan(self, values: Sequence[Tokens], calls, extra_positions: list[int], what: str, scratch: int = 0,
              mapped_ids=()) -> _Plan:
        """Validate the calls and place their parents. The first `scratch` calls are scratch calls, which the
        others may name as `Scratch(i)` parents. The parents in `mapped_ids` are read mapped by the decode calls
        and unmapped by scratch calls: an entry for each."""
        n = len(calls)
        if n == 0:
            raise BraidError("no calls given")
        if n > self.config.max_parallel_calls:
            raise BraidError(f"{n} parallel calls exceed max_parallel_calls={self.config.max_parallel_calls}")
        limit = self.spec.max_positions
        index: dict[tuple[str, int, bool], int] = {}
        entries: list[tuple[Message, int]] = []
        mapped: list[bool] = []
        call_entries, call_scratch, tokens, new_offsets, parent_offsets = [], [], [], [], []
        for c, call in enumerate(calls):
            toks = self._as_tokens(values[c], what, c)
            parents = list(call.parents)
            offsets = call.offsets
            if offsets is not None and len(offsets) != len(parents):
                raise InvalidOffsetError(f"call {c}: {len(offsets)} offsets given for {len(parents)} parents")
            end, mine, reads, placed = 0, [], [], []
            for i, pid in enumerate(parents):
                if isinstance(pid, Scratch):
                    if c < scratch or not 0 <= pid.index < scratch:
                        raise BraidError(f"call {c}: {pid} is not a scratch call this call can read")
                    off = new_offsets[pid.index]
                    if offsets is not None and offsets[i] not in (None, off):
                        raise InvalidOffsetError(f"call {c}: scratch call {pid.index} is encoded at offset {off}, "
                                                 f"not {offsets[i]}")
                    reads.append(pid.index)
                    placed.append(off)
                    end = off + len(tokens[pid.index])
                    continue
                msg = self.store.get(pid)
                if msg.fingerprint != self.fingerprint:
                    raise FingerprintMismatchError(
                        f"call {c}: parent {pid!r} was encoded by model {msg.fingerprint}, this engine runs "
                        f"{self.fingerprint}; re-encode its text with this model")
                off = end if offsets is None or offsets[i] is None else offsets[i]
                if not isinstance(off, int) or off < 0 or off + msg.num_tokens > limit:
                    raise InvalidOffsetError(
                        f"call {c}: offset {off!r} for parent {pid!r} ({msg.num_tokens} tokens) is out of range; "
                        f"it must be an int with 0 <= offset and offset + length <= {limit}")
                key = (pid, off, c >= scratch and pid in mapped_ids)  # (mapped: an entry of its own)
                mine.append(index.setdefault(key, len(entries)))
                if mine[-1] == len(entries):
                    entries.append((msg, off))
                    mapped.append(key[2])
                placed.append(off)
                end = off + msg.num_tokens
            new_off = end if call.new_offset is None else call.new_offset
            if not isinstance(new_off, int) or new_off < 0:
                raise InvalidOffsetError(f"call {c}: new_offset {new_off!r} must be a non-negative int")
            if new_off + len(toks) + extra_positions[c] > limit:
                raise ContextOverflowError(
                    f"call {c}: new_offset {new_off} + {len(toks)} {what} tokens + {extra_positions[c]} max new "
                    f"tokens = {new_off + len(toks) + extra_positions[c]} exceeds the context of {limit} positions")
            call_entries.append(mine)
            call_scratch.append(reads)
            tokens.append(toks)
            new_offsets.append(new_off)
            parent_offsets.append(tuple(placed))
        visible = torch.zeros(n, len(entries) + n, dtype=torch.bool)
        for c, mine in enumerate(call_entries):
            visible[c, mine] = True
            visible[c, len(entries) + c] = True
            visible[c, [len(entries) + i for i in call_scratch[c]]] = True
        side = [0] * len(entries)  # 0: only scratch calls read it, 1: both sides, 2: only decode calls
        if scratch:
            by_scratch, by_decode = visible[:scratch, :len(entries)].any(0), visible[scratch:, :len(entries)].any(0)
            side = (by_decode.long() + (~by_scratch).long()).tolist()
            order = sorted(range(len(entries)), key=side.__getitem__)
            entries, mapped = [entries[e] for e in order], [mapped[e] for e in order]
            visible = torch.cat([visible[:, order], visible[:, len(entries):]], dim=1)
            side = sorted(side)
        return _Plan(entries, visible.to(self.lm.device), tokens, new_offsets,
                     [tuple(c.parents) for c in calls], parent_offsets, [new_message_id() for _ in calls],
                     scratch=scratch, mapped=mapped, scratch_only=side.count(0) if scratch else 0,
                     scratch_at=side.count(0) + side.count(1) if scratch else 0)

    def _assemble(self, plan: _Plan, extra_tokens: int, transform: KVTransform | None, blocks: list[int],
                  in_place: list[bool], runs: list) -> WorkCache:
        """A work cache (over `blocks` of the pool) reading each parent in place (`runs`, in order, for the
        entries `in_place`) or holding a copy of it, re-rotated to its offset, and mapped for the decode calls'
        entries of the parents the transform maps (from the unmapped copy placed for scratch calls, if any).
        With scratch calls, their tokens' slots are claimed between the entries they read and the others."""
        context = sum(m.num_tokens for m, _ in plan.entries)
        cache = WorkCache(self.lm, context + sum(map(len, plan.tokens)) + extra_tokens, self.scheduler.pool, blocks)
        cache.start = sum(m.num_tokens for m, _ in plan.entries[:plan.scratch_only])
        unmapped: dict[tuple[str, int], torch.Tensor] = {}  # the slots of unmapped copies a mapped entry may take
        runs = iter(runs)
        for e, entry in enumerate(plan.entries + [None]):
            if plan.scratch and e == plan.scratch_only:
                cache.front = cache.claimed
            if plan.scratch and e == plan.scratch_at:
                cache.reserve_scratch(torch.tensor([len(plan.entries) + c for c in range(plan.scratch)
                                                    for _ in plan.tokens[c]], device=cache.index.device))
            if entry is None:
                break
            msg, off = entry
            if in_place[e]:
                cache.reference(next(runs), segment=e)
                continue
            mapped = plan.mapped[e]
            slots = unmapped.pop((msg.id, off), None) if mapped else None
            # (one copy at a time, read back from the pool rather than kept: no more memory held at once than
            # one message's copy, which the allocator then reuses)
            placed = cache.gather(slots) if slots is not None else self._placed(msg, off)
            if mapped:
                placed = placed.clone() if placed is msg.kv else placed  # (a transform may work in place)
                placed = transform.apply(msg, placed)
            elif transform is not None and msg.id in transform.ids:
                unmapped[(msg.id, off)] = torch.arange(cache.length, cache.length + msg.num_tokens,
                                                       device=cache.index.device)
            cache.append(placed, segment=e)
        return cache

    def _placed(self, msg: Message, off: int) -> torch.Tensor:
        """The message's KV [L, 2, H, T, D] at offset `off`: its own (not a copy) where it was encoded there."""
        if off == msg.offset:
            return msg.kv
        delta = torch.full((msg.num_tokens,), off - msg.offset, dtype=torch.long, device=msg.kv.device)
        return torch.stack([rerotate_keys(msg.kv[:, 0], delta, self.lm.inv_freq), msg.kv[:, 1]], dim=1)

    def _commit(self, plan: _Plan, cache: WorkCache, tokens: list[list[int]], slots: list[list[int]],
                fingerprint: str | None = None, cache_prefill: bool = False) -> list[str]:
        """Store the call's messages (a reused cached start put back in front); with prefix caching, each gets
        its content key, and prefills also a hidden twin over the same KV that the cache keeps after the
        caller frees its message, until the store evicts it."""
        messages, twins = [], []
        for c in range(plan.scratch, len(tokens)):  # (scratch calls store nothing)
            kv = cache.gather(torch.tensor(slots[c], dtype=torch.long, device=self.lm.device))
            toks, offset = tokens[c], plan.new_offsets[c]
            prefix = plan.prefix[c] if plan.prefix else None
            if prefix is not None:
                kv, toks, offset = torch.cat([prefix.kv, kv], dim=3), [*prefix.token_ids, *toks], prefix.offset
            seed = plan.seeds[c] if plan.seeds else None
            keys = self.prefix_cache.keys(seed, toks) if seed is not None else None  # (hashed once, used twice)
            read = [(p, o) for p, o in zip(plan.parents[c], plan.parent_offsets[c]) if not isinstance(p, Scratch)]
            messages.append(Message(plan.new_ids[c], tuple(toks), kv, offset, tuple(p for p, _ in read),
                                    tuple(o for _, o in read), fingerprint or self.fingerprint,
                                    keys[-1][1] if keys else None))
            if cache_prefill and keys:
                twins.append((keys, replace(messages[-1], id=f"{CACHED_PREFIX}{messages[-1].id}")))
        with self._store_lock:
            self.store.add(messages + [t for _, t in twins])
            self.store.touch(plan.parent_ids)
            for keys, twin in twins:
                self.prefix_cache.insert(keys, twin)
            if self.prefix_cache is not None and len(self.prefix_cache) > 8 * len(self.store) + 4096:
                self.prefix_cache.prune(self.store)
        return [m.id for m in messages]


def _cpu_threads(config: EngineConfig, lm: LoadedModel, caller_threads: int) -> int:
    """The scheduler's intra-op threads on CPU (EngineConfig.cpu_threads; 0: `caller_threads`, the count of the
    thread making the engine); 0 on CUDA: left as they are."""
    if lm.device.type != "cpu":
        return 0
    return config.cpu_threads or caller_threads


def _kv_budget(config: EngineConfig, device: torch.device) -> int:
    if config.kv_budget_bytes:
        return config.kv_budget_bytes
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 2
    return 256 << 20


class _SharedTokenizer:
    """The model's tokenizer, used from caller threads and the scheduler's: a fast tokenizer may not be
    used by two threads at once (it can fail with "Already borrowed"), so encode and decode take a lock."""

    def __init__(self, tokenizer):
        self._tokenizer, self._lock = tokenizer, threading.Lock()

    def encode(self, *args, **kwargs):
        with self._lock:
            return self._tokenizer.encode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        with self._lock:
            return self._tokenizer.decode(*args, **kwargs)

    def decode_step(self, stream, token: int) -> str | None:
        """One token through a tokenizers DecodeStream (engine.detokenize): its new text, or None (held back)."""
        with self._lock:
            return stream.step(self._tokenizer.backend_tokenizer, token)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)
