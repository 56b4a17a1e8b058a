"""The choreography API over a message store: requests of parallel calls, prefilled or decoded.

Every request is validated and planned in the caller's thread before anything runs, then runs in the
scheduler (engine.scheduler), batched with every other request in flight. Messages are inserted into the
store only when the whole request has succeeded, so a failed request leaves the store exactly as it was.
"""

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch

from braid.engine.call import Adapter, Call, TokenEvent
from braid.engine.config import EngineConfig
from braid.engine.cuda_graphs import DecodeGraphs
from braid.engine.errors import (
    BraidError,
    ContextOverflowError,
    EmptyHeaderError,
    FingerprintMismatchError,
    InvalidOffsetError,
    PreconditionError,
)
from braid.engine.host import to_device
from braid.engine.kv_cache import KVPool, WorkCache
from braid.engine.model import LoadedModel, load_model
from braid.engine.model_runner import ModelRunner
from braid.engine.prefix_cache import PrefixCache, content_seed
from braid.engine.sampling import SamplingParams
from braid.engine.scheduler import Request, RequestStatus, Scheduler
from braid.engine.store import DenseKV, Message, MessageStore, PagedAlloc, PagedKV, new_message_id
from braid.engine.threads import one_thread
from braid.kernels import rerotate_keys, rerotate_keys_

log = logging.getLogger(__name__)
CACHED_PREFIX = "~cached-"  # ids of the prefix cache's own messages (never given to callers)

Tokens = str | Sequence[int]


@dataclass(frozen=True)
class KVTransform:
    """A decode request's KV seam (a cache mapper): `apply(message, kv)` maps the placed copy [L, 2, H, T, D] of
    each parent in `ids` (it may work in place: the copy is the engine's own) before its decode calls attend to
    it. The request's prefill calls read the same parents unmapped."""

    ids: frozenset[str]
    apply: Callable[[Message, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Sibling:
    """A parent that is prefill call `index` of the same request: encoded in the same forwards, before the
    decode calls that read it, at its own new_offset."""

    index: int


@dataclass
class PrefillCall:
    message: Tokens
    parents: Sequence[str | Sibling] = ()
    offsets: Sequence[int | None] | None = None  # None entries: directly after the previous parent
    new_offset: int | None = None  # None: directly after the last parent
    # False: encoded only for its request's decode calls to read (as a Sibling), never stored
    store: bool = True
    adapter: str | None = None  # the adapter its rows run on (Engine.add_adapter); None: the base weights
    # the id its message is stored under (None: a new one): a message encoded again from its record keeps its id
    id: str | None = None


@dataclass
class DecodeCall:
    header: Tokens  # non-empty: the first generated token is predicted from its last token
    parents: Sequence[str | Sibling] = ()
    offsets: Sequence[int | None] | None = None
    new_offset: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None  # its message is stored as encoded by "<fingerprint>+<adapter>"


@dataclass
class _Plan:
    """A request as planned: its calls (engine.call.Call, each what it encodes, where, and what it read) and
    the context they read, placed."""

    entries: list[tuple[Message, int]]  # placed context: (parent, offset), deduplicated
    visible: torch.Tensor  # bool [calls, entries + calls]
    calls: list[Call]
    lead: int = 0  # the first calls are prefill calls its decode calls read
    # With lead calls, entries are ordered: those only lead calls read (`lead_only` of them), those both sides
    # read, then (after the lead tokens' slots) those only decode calls read: each side's one run.
    lead_only: int = 0
    lead_at: int = 0  # the entry before which the lead tokens' slots go
    mapped: list[bool] = field(default_factory=list)  # per entry: a decode call's copy through the transform

    @property
    def parent_ids(self) -> set[str]:
        return {m.id for m, _ in self.entries}


class DecodeStream:
    """Iterate for TokenEvents; `ids` holds the stored message ids (in call order) once iteration ends.

    The request runs in the scheduler from the moment it is made; iterating reads its tokens as they come.
    Calls are numbered among its decode calls. `timings` (seconds) fills in as it runs: `queued` (waiting for KV
    budget), `assemble` (placing parents into the work cache), `first_token` (from the request to the first
    sampled token), `decode` (the rest).
    """

    def __init__(self, request: Request, store: MessageStore):
        self._request, self._store = request, store
        self._events = request.results()
        self.timings = request.timings
        self.ids: list[str] | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        self.ids = yield from self._events

    def close(self) -> None:
        """Stop a stream early: it leaves the batch, its messages are not stored (unless it had already
        ended), and its parents are unpinned by the time this returns."""
        self._events.close()
        self._request.cancel()
        if self.ids is None and self._request.stored_ids is not None:  # it had ended, stored, before the close
            self.ids = self._request.stored_ids

    def interrupt(self) -> None:
        """From any thread: the request leaves the batch at the next step, and whoever iterates it sees it end
        with an error (`close` is for the thread that iterates it)."""
        self._request.request_cancel()

    def _call(self, call: int) -> Call:
        return self._request.decode_calls[call]

    def encoded(self, call: int) -> int:
        """How many of the call's tokens (header included) already have KV. It grows as the scheduler runs,
        which may be ahead of the events read so far: read it once per use. Only for a stream made with
        `readable=True` (a preempted call would have less)."""
        r = self._request
        if r.grows and r.status is not RequestStatus.STORED:
            raise BraidError("this decode stream's work KV is not readable while it runs (it may be preempted); "
                             "make it with Engine.decode_stream(..., readable=True)")
        c = self._call(call)
        return c.reused + len(c.slots)

    def offset(self, call: int) -> int:
        """Where the call's message starts (the position of its first token, a reused cached start included)."""
        c = self._call(call)
        return c.offset - c.reused

    def partial_kv(self, call: int, start: int, end: int) -> tuple[list[int], torch.Tensor]:
        """Tokens [start, end) of the call's message and their KV [L, 2, H, T, D], while it decodes, or
        from the stored message once it has ended."""
        r, c = self._request, self._call(call)
        with r.lock:  # (the work cache is not handed to another request while this reads it)
            if r.status is RequestStatus.STORED:
                msg = self._store.get(c.message_id)
                return list(msg.token_ids[start:end]), msg.kv.read(start, end).contiguous()
            if r.status.ended:
                raise BraidError(f"call {call} ended without storing its message")
            if not 0 <= start <= end <= self.encoded(call):  # (encoded refuses a stream that may be preempted)
                raise BraidError(f"call {call}: tokens {start}-{end} are not encoded yet ({self.encoded(call)} are)")
            n = c.reused
            tokens, parts = [], []
            if start < n:  # the cached start it reused
                tokens += c.prefix.token_ids[start:min(end, n)]
                parts.append(c.prefix.kv.read(start, min(end, n)))
            if end > n:
                lo = max(start, n) - n
                slots = to_device(c.slots[lo:end - n], r.cache.index.device)
                tokens += c.all_tokens[lo:end - n]
                parts.append(r.cache.gather(slots))
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
            self.paged = config.kv_home == "paged"  # stored messages' KV lives in the pool (engine.store.PagedKV)
            self.store = MessageStore(_store_budget(config, self.lm.device) if self.paged
                                      else config.store_budget_bytes)
            if config.attention == "flex" and self.lm.device.type == "cuda" and config.kv_block_tokens < 16:
                raise ValueError(f"attention flex on CUDA needs kv_block_tokens of 16 or more (its kernel's smallest "
                                 f"tile), got {config.kv_block_tokens}")
            self.runner = ModelRunner(self.lm, config.attention, config.compile)
            self.lock = threading.RLock()
            self._store_lock = threading.Lock()
            self.prefix_cache = PrefixCache(config.prefix_block_tokens) if config.prefix_caching else None
            self.adapters: dict[str, Adapter] = {}  # what calls may name as their adapter (add_adapter)
            s = self.spec
            # one token's keys and values over every layer: what a message costs per token, stored or shipped
            self.kv_bytes_per_token = s.num_layers * 2 * s.num_kv_heads * s.head_dim * self.lm.dtype.itemsize
            work = max(1, _kv_budget(config, self.lm.device) // self.kv_bytes_per_token // config.kv_block_tokens)
            stored = self.store.budget_bytes // self.kv_bytes_per_token // config.kv_block_tokens if self.paged else 0
            self.scheduler = Scheduler(self.runner, config.max_batched_tokens,
                                       KVPool(self.lm, work + stored, config.kv_block_tokens, work,
                                              zeroed=self.runner.in_place),
                                       config.max_running_calls, name=self.fingerprint[:8],
                                       mix_adapters=config.mix_adapters,
                                       threads=_cpu_threads(config, self.lm, caller_threads), adapters=self.adapters,
                                       overlap=config.overlap)
            graphs = config.decode_graphs
            if not self.runner.in_place and (graphs == "eager" or (graphs == "auto" and self.lm.device.type == "cuda")):
                self.runner.graphs = DecodeGraphs(self.runner, self.scheduler.pool, capture=graphs == "auto")
            log.info("engine ready: %s, fingerprint %s, %d positions", config.model_path, self.fingerprint,
                     self.spec.max_positions)

    def add_adapter(self, adapter_id: str, adapter: Adapter) -> None:
        """Let calls name `adapter_id` as their adapter: their rows run on its weights, and their messages are
        stored as encoded by "<fingerprint>+<adapter_id>", which no base-weight call takes as a parent. Adding
        the same adapter again is a no-op; another one under a taken id is refused."""
        if not adapter_id or "+" in adapter_id:
            raise BraidError(f"adapter id {adapter_id!r} must be non-empty and hold no '+'")
        if self.adapters.get(adapter_id, adapter) is not adapter:
            raise BraidError(f"adapter id {adapter_id!r} is taken by another adapter")
        self.adapters[adapter_id] = adapter

    @property
    def kv_copied(self) -> dict[str, int]:
        """KV bytes copied since the engine started, at reuse (parents copied into the pool) and at commit (a
        finished call's KV copied out into its message): engine.kv_cache.KVPool.copied."""
        return dict(self.scheduler.pool.copied)

    def encoded_by(self, adapter_id: str | None) -> str:
        """The fingerprint messages encoded on these weights are stored under."""
        return self.fingerprint if adapter_id is None else f"{self.fingerprint}+{adapter_id}"

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

    def discard(self, message_ids: Sequence[str], when_unpinned: bool = True) -> int:
        """Free each of these messages that is still stored (one already freed or evicted is skipped); one a
        running call uses goes as soon as no call uses it (`when_unpinned`; false: MessageInUseError). Returns
        how many were still stored."""
        freed = 0
        with self._store_lock:
            for mid in message_ids:
                if mid in self.store:
                    self.store.free(mid, when_unpinned)
                    freed += 1
        return freed

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
                       message_id: str | None = None, unrecorded: str = "") -> str:
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
                      DenseKV(kv.to(self.lm.device).contiguous()), offset, tuple(parents), tuple(parent_offsets),
                      fingerprint, unrecorded=unrecorded)
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
        copies = [self._placed_copy(p, o) for p, o in parents]
        return copies[0] if len(copies) == 1 else torch.cat(copies, dim=3)

    def view(self, message_id: str, start: int, end: int) -> str:
        """A new message over tokens [start, end) of a stored one, at their own positions, sharing its KV (no
        copy); freed like any other. Its content key is unknown, so nothing encoded after it is prefix-cached."""
        with self._store_lock:
            msg = self.store.get(message_id)
            if not 0 <= start < end <= msg.num_tokens:
                raise BraidError(f"view [{start}, {end}) of message {message_id!r} is out of range: it has "
                                 f"{msg.num_tokens} tokens")
            part = Message(new_message_id(), msg.token_ids[start:end], msg.kv.part(start, end),
                           msg.offset + start, (message_id,), (msg.offset,), msg.fingerprint)
            self.store.add([part])
        return part.id

    # ---- the choreography API -------------------------------------------------------------------
    def prefill(self, calls: Sequence[PrefillCall]) -> list[str]:
        """Encode each call's message (all in one request); each message stays contiguous. A message found in
        the prefix cache whole is not encoded again: it shares the cached KV."""
        if any(not c.store for c in calls):
            raise BraidError("a prefill call that is not stored is read by its request's decode calls only: "
                             "give it to decode_stream with them")
        request, ready = self._submit(calls, None)
        encoded = []
        if request is not None:
            events = request.results()
            try:
                while True:
                    next(events)
            except StopIteration as done:
                encoded = done.value
            except BaseException:  # the whole request fails: the messages found in the cache go too
                self.discard(list(ready.values()), when_unpinned=False)
                raise
        encoded = iter(encoded)
        return [ready[c] if c in ready else next(encoded) for c in range(len(calls))]

    def decode(self, calls: Sequence[DecodeCall], on_token: Callable[[TokenEvent], None] | None = None) -> list[str]:
        stream = self.decode_stream(calls)
        for event in stream:
            if on_token is not None:
                on_token(event)
        return stream.ids

    def decode_stream(self, calls: Sequence[PrefillCall | DecodeCall], transform: KVTransform | None = None,
                      readable: bool = False) -> DecodeStream:
        """Decode the decode calls together, one row per call per step, masked so calls never see each other.

        Prefill calls may come first: they are encoded in the same forwards, before the decode calls' headers,
        and a decode call reads one by naming `Sibling(i)` among its parents (at prefill call i's new_offset);
        they sample nothing and read parents unmapped. Validation happens here, before the first event.
        `transform`: the decode calls read its parents mapped (a cache mapper, methods.synthesis).
        `readable`: its KV is read while it decodes (`DecodeStream.partial_kv`), so it holds work KV for all its
        `max_tokens` from the start and is never preempted; otherwise (with `kv_on_demand`) it may take its
        blocks as it decodes.
        """
        if calls and not any(isinstance(c, DecodeCall) for c in calls):  # (no calls at all: _check_options says so)
            raise BraidError("a decode request needs at least one DecodeCall")
        request, _ = self._submit(calls, transform, grows=self.config.kv_on_demand and not readable)
        return DecodeStream(request, self.store)

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

    def _submit(self, calls: Sequence[PrefillCall | DecodeCall], transform: KVTransform | None,
                grows: bool = False) -> tuple[Request | None, dict[int, str]]:
        """Validate and plan in the caller's thread (errors surface here), reuse what the prefix cache holds,
        pin the parents, hand the rest to the scheduler. Returns the request (None: nothing left to encode)
        and the ids of prefill calls found whole in the cache, by call index."""
        lead = self._check_options(calls)
        with self._store_lock:
            plan = self._plan(calls, lead, transform.ids if transform is not None else ())
            ready: dict[int, str] = {}
            views: list[str] = []
            # A mapped or adapted call's KV is not what the base model gives for the same content: not cached;
            # nor is a call that reads its siblings (no stored content to key it by).
            if self.prefix_cache is not None and transform is None and not lead \
                    and all(c.adapter is None for c in calls):
                plan, ready, views = self._reuse(plan)
            pins = self.store.pin(plan.parent_ids if plan is not None else ())
        work = _RequestKV(self, plan, transform, pins, views)
        if plan is None:
            work.release()
            return None, ready
        try:
            request = work.request(grows)
            self.scheduler.submit(request)
        except BaseException:
            work.release()
            self.discard(list(ready.values()), when_unpinned=False)
            raise
        return request, ready

    def _check_options(self, calls: Sequence[PrefillCall | DecodeCall]) -> int:
        """The calls' options, checked: returns how many prefill calls lead a decode request."""
        if not calls:
            raise BraidError("no calls given")
        decodes = [isinstance(c, DecodeCall) for c in calls]
        lead = decodes.index(True) if any(decodes) else 0
        if any(decodes) and not all(decodes[lead:]):
            raise BraidError(f"call {decodes.index(False, lead)}: a request's prefill calls come before its decode "
                             "calls")
        adapters = {c.adapter for c in calls} - {None}
        for a in adapters:
            if a not in self.adapters:
                raise PreconditionError(f"adapter {a!r} is not loaded on this engine (loaded: "
                                        f"{sorted(self.adapters) or 'none'})")
        if len(adapters) > 1:
            raise BraidError(f"one request runs on one adapter besides the base weights; these calls name "
                             f"{sorted(adapters)}")
        # (a step of short rows may replay a graph captured under one set of weights, over every row:
        # engine.cuda_graphs; only lead calls' rows, never such a step, may run on the base weights beside them)
        if len({c.adapter for c in calls[lead:]}) > 1 or any(c.adapter not in (None, calls[lead].adapter)
                                                             for c in calls[:lead]):
            raise BraidError("a request's calls run on the same weights (its lead prefill calls may run on the base "
                             "ones): name one adapter on all of them, or on none")
        stored = [i for i, c in enumerate(calls[:lead]) if c.store]
        if stored:
            raise BraidError(f"call {stored[0]}: a prefill call ahead of decode calls is read by them only; give "
                             "it store=False (prefill it on its own to store it)")
        named = [c.id for c in calls if isinstance(c, PrefillCall) and c.id is not None]
        taken = [i for i in named if i in self.store or named.count(i) > 1]
        if taken:
            raise BraidError(f"message id {taken[0]!r} is taken: a prefill call's id must be new to the store")
        return lead

    def _in_place(self, plan: _Plan, transform: KVTransform | None, own_tokens: int) -> list[bool]:
        """Which of the call's parents it reads in place rather than copying into its own blocks: those placed where
        they were encoded and untransformed that live in the pool (kv_home paged: their own slots, no copy) or are a
        block long at least (a dense message: a run of the pool, one copy for every running call that reads it so).
        None when they are mostly copied anyway (a cache of the call's own blocks is read as a view each forward,
        where reading any parent in place gathers the whole cache each forward), nor when their runs would not fit
        the pool."""
        pool, none = self.scheduler.pool, [False] * len(plan.entries)
        if transform is not None or not self.config.share_parents:
            return none
        home = [off == m.offset and self._at_home(m) for m, off in plan.entries]  # (in place: no copy, no run)
        yes = [h or off == m.offset and m.num_tokens >= pool.block_tokens for h, (m, off) in zip(home, plan.entries)]
        shared = [m.num_tokens for h, (m, _), y in zip(home, plan.entries, yes) if y and not h]
        kept = sum(m.num_tokens for (m, _), y in zip(plan.entries, yes) if y)
        copied = sum(m.num_tokens for (m, _), y in zip(plan.entries, yes) if not y)
        fits = pool.blocks_for(own_tokens + copied) + sum(map(pool.blocks_for, shared)) <= pool.work_blocks
        # (a call that copies most of its context anyway copies it all, its paged parents too: its cache is then one
        # run of its own blocks, read as a view each forward, where reading any parent in place gathers the whole
        # cache each forward, which costs more than the copy: benchmarks/results/ab_synthesis_ttft_100m_paged.json)
        return yes if fits and kept >= copied else none

    def _at_home(self, msg: Message) -> bool:
        """Whether the message's KV lives in this engine's pool (engine.store.PagedKV): where it was encoded, it is
        read in place without a run of its own (`_in_place`)."""
        return isinstance(msg.kv, PagedKV) and msg.kv.pool is self.scheduler.pool

    def _reuse(self, plan: _Plan):
        """Look every call up in the prefix cache (store lock held). A prefill call found whole becomes a
        message sharing the cached KV at once; a call whose start is cached gets that start as a lent parent
        (a view, no copy) and encodes only the rest, placed again with it. Returns (plan of what is left or
        None, ready ids by call index, lent view ids)."""
        cache = self.prefix_cache
        for call in plan.calls:
            call.seed = content_seed(self.fingerprint, [(self.store.get(p).content_key, off) for p, off in
                                                        zip(call.parents, call.parent_offsets)], call.offset)
        hits = [cache.lookup(c.seed, c.tokens, len(c.tokens) - c.decodes, self.store) for c in plan.calls]
        if not any(hits):
            return plan, {}, []
        ready, views, left = {}, [], []
        for c, (call, hit) in enumerate(zip(plan.calls, hits)):
            if hit is None:
                left.append((call, None, self._spec(call)))
                continue
            msg, n = hit
            kv = msg.kv.part(0, n)  # the same memory (itself when whole)
            self.store.touch([msg.id])
            if n == len(call.tokens):  # a prefill found whole
                mine = Message(call.message_id, tuple(call.tokens), kv, call.offset, call.parents,
                               call.parent_offsets, msg.fingerprint, msg.content_key if n == msg.num_tokens else
                               cache.content_key(call.seed, call.tokens))
                self.store.add([mine])
                ready[c] = mine.id
                continue
            view = Message(f"~prefix-{new_message_id()}", tuple(call.tokens[:n]), kv, call.offset, (), (),
                           msg.fingerprint)
            self.store.add([view])
            views.append(view.id)
            spec = self._spec(call, call.tokens[n:])
            left.append((call, view, replace(spec, parents=[*call.parents, view.id],
                                             offsets=[*call.parent_offsets, call.offset], new_offset=call.offset + n)))
        if not left:
            return None, ready, views
        rest = self._plan([spec for _, _, spec in left], 0, ())
        for placed, (call, view, _) in zip(rest.calls, left):  # (what the messages record: not the lent views)
            placed.parents, placed.parent_offsets = call.parents, call.parent_offsets
            placed.message_id, placed.seed, placed.prefix = call.message_id, call.seed, view
        return rest, ready, views

    @staticmethod
    def _spec(call: Call, tokens: list[int] | None = None) -> PrefillCall | DecodeCall:
        """A planned call as asked for again (its tokens, or `tokens`), to place what the prefix cache left."""
        tokens = call.tokens if tokens is None else tokens
        if call.decodes:
            return DecodeCall(tokens, call.parents, call.parent_offsets, call.offset, call.sampling,
                              adapter=call.adapter)
        return PrefillCall(tokens, call.parents, call.parent_offsets, call.offset, call.store, call.adapter)

    def _plan(self, calls: Sequence[PrefillCall | DecodeCall], lead: int, mapped_ids=()) -> _Plan:
        """Validate the calls and place their parents. The first `lead` calls are prefill calls that the
        others may name as `Sibling(i)` parents. The parents in `mapped_ids` are read mapped by the decode calls
        and unmapped by the lead calls: an entry for each."""
        n = len(calls)
        if n > self.config.max_parallel_calls:
            raise BraidError(f"{n} parallel calls exceed max_parallel_calls={self.config.max_parallel_calls}")
        limit = self.spec.max_positions
        index: dict[tuple[str, int, bool], int] = {}
        entries: list[tuple[Message, int]] = []
        mapped: list[bool] = []
        call_entries, call_siblings, tokens, new_offsets, parent_offsets, unrecorded = [], [], [], [], [], []
        for c, call in enumerate(calls):
            decodes = isinstance(call, DecodeCall)
            toks = self._as_tokens(call.header if decodes else call.message, "header" if decodes else "message", c)
            extra = call.sampling.max_tokens if decodes else 0
            parents = list(call.parents)
            offsets = call.offsets
            if offsets is not None and len(offsets) != len(parents):
                raise InvalidOffsetError(f"call {c}: {len(offsets)} offsets given for {len(parents)} parents")
            end, mine, reads, placed = 0, [], [], []
            for i, pid in enumerate(parents):
                if isinstance(pid, Sibling):
                    if c < lead or not 0 <= pid.index < lead:
                        raise BraidError(f"call {c}: {pid} is not a prefill call of this request that it can read")
                    off = new_offsets[pid.index]
                    if offsets is not None and offsets[i] not in (None, off):
                        raise InvalidOffsetError(f"call {c}: prefill call {pid.index} is encoded at offset {off}, "
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
                key = (pid, off, c >= lead and pid in mapped_ids)  # (mapped: an entry of its own)
                mine.append(index.setdefault(key, len(entries)))
                if mine[-1] == len(entries):
                    entries.append((msg, off))
                    mapped.append(key[2])
                placed.append(off)
                end = off + msg.num_tokens
            new_off = end if call.new_offset is None else call.new_offset
            if not isinstance(new_off, int) or new_off < 0:
                raise InvalidOffsetError(f"call {c}: new_offset {new_off!r} must be a non-negative int")
            if new_off + len(toks) + extra > limit:
                what = "header" if decodes else "message"
                raise ContextOverflowError(
                    f"call {c}: new_offset {new_off} + {len(toks)} {what} tokens + {extra} max new "
                    f"tokens = {new_off + len(toks) + extra} exceeds the context of {limit} positions")
            call_entries.append(mine)
            call_siblings.append(reads)
            # what shaped its KV that its message will not record (a reader of its record cannot encode it again)
            unrecorded.append("a KV transform's copies of its parents" if c >= lead and set(parents) & set(mapped_ids)
                              else "unstored prefill calls of its request" if reads else "")
            tokens.append(toks)
            new_offsets.append(new_off)
            parent_offsets.append(tuple(placed))
        visible = torch.zeros(n, len(entries) + n, dtype=torch.bool)
        for c, mine in enumerate(call_entries):
            visible[c, mine] = True
            visible[c, len(entries) + c] = True
            visible[c, [len(entries) + i for i in call_siblings[c]]] = True
        side = [0] * len(entries)  # 0: only lead calls read it, 1: both sides, 2: only decode calls
        if lead:
            by_lead, by_decode = visible[:lead, :len(entries)].any(0), visible[lead:, :len(entries)].any(0)
            side = (by_decode.long() + (~by_lead).long()).tolist()
            order = sorted(range(len(entries)), key=side.__getitem__)
            entries, mapped = [entries[e] for e in order], [mapped[e] for e in order]
            visible = torch.cat([visible[:, order], visible[:, len(entries):]], dim=1)
            side = sorted(side)
        planned = []
        for call, toks, off, offs, gap in zip(calls, tokens, new_offsets, parent_offsets, unrecorded):
            read = [(p, o) for p, o in zip(call.parents, offs) if not isinstance(p, Sibling)]
            decodes = isinstance(call, DecodeCall)
            planned.append(Call(toks, off, (None if decodes else call.id) or new_message_id(),
                                call.sampling if decodes else None, decodes or call.store, call.adapter,
                                tuple(p for p, _ in read), tuple(o for _, o in read), unrecorded=gap))
        return _Plan(entries, visible.to(self.lm.device), planned, lead=lead, mapped=mapped,
                     lead_only=side.count(0) if lead else 0, lead_at=side.count(0) + side.count(1) if lead else 0)

    def _assemble(self, plan: _Plan, extra_tokens: int, transform: KVTransform | None, blocks: list[int],
                  in_place: list[bool], runs: list) -> WorkCache:
        """A work cache (over `blocks` of the pool) reading each parent in place (`runs`, in order, for the
        entries `in_place`) or holding a copy of it, re-rotated to its offset, and mapped for the decode calls'
        entries of the parents the transform maps (from the unmapped copy placed for lead calls, if any).
        With lead calls, their tokens' slots are claimed between the entries they read and the others."""
        context = sum(m.num_tokens for m, _ in plan.entries)
        cache = WorkCache(self.lm, context + sum(len(c.tokens) for c in plan.calls) + extra_tokens,
                          self.scheduler.pool, blocks)
        cache.start = sum(m.num_tokens for m, _ in plan.entries[:plan.lead_only])
        unmapped: dict[tuple[str, int], torch.Tensor] = {}  # the slots of unmapped copies a mapped entry may take
        runs = iter(runs)
        for e, entry in enumerate(plan.entries + [None]):
            if plan.lead and e == plan.lead_only:
                cache.front = cache.claimed
            if plan.lead and e == plan.lead_at:
                cache.reserve_lead(to_device([len(plan.entries) + c for c in range(plan.lead)
                                              for _ in plan.calls[c].tokens], cache.index.device))
            if entry is None:
                break
            msg, off = entry
            if in_place[e]:
                if self._at_home(msg):
                    cache.reference_slots(msg.kv.index, segment=e, blocks=msg.kv.blocks)
                else:
                    cache.reference(next(runs), segment=e)
                continue
            if plan.mapped[e]:
                # (one copy at a time, read back from the pool rather than kept: no more memory held at once than
                # one message's copy, which the allocator then reuses; the engine's own, which a transform may
                # work in place on)
                slots = unmapped.pop((msg.id, off), None)
                placed = transform.apply(msg, cache.gather(slots) if slots is not None else self._placed_copy(msg, off))
                keys, values = placed[:, 0], placed[:, 1]
            else:
                keys, values = self._placed(msg, off)
                if transform is not None and msg.id in transform.ids:
                    unmapped[(msg.id, off)] = torch.arange(cache.length, cache.length + msg.num_tokens,
                                                           device=cache.index.device)
            cache.append(keys, values, segment=e)
        return cache

    def _placed(self, msg: Message, off: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The message's keys and values [L, H, T, D] at offset `off`, apart (whoever copies them into the pool
        copies each once, with no [L, 2, H, T, D] stacked in between): a dense message's own (views, no copy)
        where it was encoded there, its keys re-rotated into a new tensor elsewhere."""
        keys, values = msg.kv.keys_values()
        if off != msg.offset:
            keys = rerotate_keys(keys, self._delta(msg, off), self.lm.inv_freq)
        return keys, values

    def _placed_copy(self, msg: Message, off: int) -> torch.Tensor:
        """The message's KV [L, 2, H, T, D] at offset `off` in one tensor of the caller's own (which a transform may
        work in place on): one copy, its keys re-rotated in it."""
        kv = msg.kv.copy()
        if off != msg.offset:
            rerotate_keys_(kv[:, 0], self._delta(msg, off), self.lm.inv_freq)
        return kv

    def _delta(self, msg: Message, off: int) -> torch.Tensor:
        """[T]: how far each of the message's tokens moves to be read at offset `off`."""
        return torch.full((msg.num_tokens,), off - msg.offset, dtype=torch.long, device=self.lm.device)

    def _commit(self, plan: _Plan, request: Request) -> list[str]:
        """Store the messages of the request's stored calls (a reused cached start put back in front); with
        prefix caching, each gets its content key, and prefills also a hidden twin over the same KV that the
        cache keeps after the caller frees its message, until the store evicts it."""
        messages, twins = [], []
        handles = self._paged_handles(request) if self.paged else {}
        for c, call in enumerate(request.calls):
            if not call.store:
                continue
            toks, offset = call.all_tokens, call.offset
            if c in handles:  # (in the blocks it was written to: nothing copied)
                kv = handles[c]
            else:
                kv = request.cache.gather(to_device(call.slots, self.lm.device))
                self.scheduler.pool.copied["commit"] += kv.nbytes
                if call.prefix is not None:
                    kv = torch.cat([call.prefix.kv.read(), kv], dim=3)
                kv = DenseKV(kv)
            if call.prefix is not None:
                toks, offset = [*call.prefix.token_ids, *toks], call.prefix.offset
            keys = self.prefix_cache.keys(call.seed, toks) if call.seed is not None else None  # (hashed once)
            messages.append(Message(call.message_id, tuple(toks), kv, offset, call.parents,
                                    call.parent_offsets, self.encoded_by(call.adapter), keys[-1][1] if keys else None,
                                    call.unrecorded))
            if not call.decodes and keys:
                twins.append((keys, replace(messages[-1], id=f"{CACHED_PREFIX}{messages[-1].id}")))
        try:
            with self._store_lock:
                self._store(messages, twins, plan)
        except BaseException:  # (not stored: the blocks they would have held go back with the call's)
            for h in handles.values():  # (only the allocation made here: a cached start's is not this call's)
                h.allocs[-1].release()
            raise
        return [m.id for m in messages]

    def _paged_handles(self, request: Request) -> dict[int, PagedKV]:
        """Each stored call's KV where the call wrote it, by call index: its slots in the pool, after its cached
        start's where that lives in the pool too (a start shipped in is copied as a dense message, the call
        left out here). The calls share one PagedAlloc over every block their slots touch."""
        cache = request.cache
        slots: dict[int, torch.Tensor] = {}
        blocks: set[int] = set()
        for c, call in enumerate(request.calls):
            if call.store and (call.prefix is None or self._at_home(call.prefix)):
                slots[c] = cache.index[to_device(call.slots, cache.index.device)]
                blocks |= cache.blocks_of(call.slots)
        if not slots:
            return {}
        alloc = PagedAlloc(self.scheduler.pool, sorted(blocks))
        out = {}
        for c, own in slots.items():
            start = request.calls[c].prefix  # (after a cached start: its slots first, in the allocations they lie in)
            out[c] = PagedKV((alloc,), own) if start is None else \
                PagedKV((*start.kv.allocs, alloc), torch.cat([start.kv.index, own]))
        return out

    def _store(self, messages: list[Message], twins: list, plan: _Plan) -> None:
        """(store lock held) The committed messages and their prefix-cache twins into the store."""
        self.store.add(messages + [t for _, t in twins])
        self.store.touch(plan.parent_ids)
        for keys, twin in twins:
            self.prefix_cache.insert(keys, twin)
        if self.prefix_cache is not None and len(self.prefix_cache) > 8 * len(self.store) + 4096:
            self.prefix_cache.prune(self.store)


class _RequestKV:
    """One request's KV on the engine's side (engine.scheduler.RequestKV): its plan, the pins on its parents,
    the cached starts lent to it; its work cache assembled over the blocks the scheduler gives it."""

    def __init__(self, engine: Engine, plan: _Plan | None, transform: KVTransform | None, pins: list[str],
                 views: list[str]):
        self.engine, self.plan, self.transform, self.pins, self.views = engine, plan, transform, pins, views

    def request(self, grows: bool) -> Request:
        """The scheduler's request for the planned calls (what is left after the prefix cache)."""
        eng, plan = self.engine, self.plan
        for call in plan.calls:
            call.start(eng.spec.eos_token_ids, eng.tokenizer, eng.lm.device)
        self.extra = sum(c.may_generate for c in plan.calls)
        own = sum(len(c.tokens) for c in plan.calls) + self.extra
        self.in_place = eng._in_place(plan, self.transform, own)
        shared = [(m.kv, off) for (m, off), yes in zip(plan.entries, self.in_place) if yes and not eng._at_home(m)]
        capacity = own + sum(m.num_tokens for (m, _), yes in zip(plan.entries, self.in_place) if not yes)
        return Request(plan.calls, plan.visible, capacity, self, shared, grows)

    def assemble(self, blocks: list[int], runs: list) -> WorkCache:
        return self.engine._assemble(self.plan, self.extra, self.transform, blocks, self.in_place, runs)

    def commit(self, request: Request) -> list[str]:
        return self.engine._commit(self.plan, request)

    def release(self) -> None:
        eng = self.engine
        with eng._store_lock:
            eng.store.unpin(self.pins)
            for v in self.views:  # the cached prefixes lent to this request
                eng.store.free(v)


def _cpu_threads(config: EngineConfig, lm: LoadedModel, caller_threads: int) -> int:
    """The scheduler's intra-op threads on CPU (EngineConfig.cpu_threads; 0: `caller_threads`, the count of the
    thread making the engine); 0 on CUDA: left as they are."""
    if lm.device.type != "cpu":
        return 0
    return config.cpu_threads or caller_threads


def _store_budget(config: EngineConfig, device: torch.device) -> int:
    """The paged home's share of the pool for stored messages: store_budget_bytes, up to what the machine can hold
    beside the work KV (a quarter of its memory on CPU, where an allocation past it is refused at once; on CUDA,
    a quarter of the device memory free before the pool is made, beside the half the work KV takes by default).
    A store budget of "whatever there is" (a benchmark's 64 GiB) becomes that."""
    if device.type == "cuda":
        room = torch.cuda.mem_get_info(device)[0] // 4
    else:
        room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    if config.store_budget_bytes > room:
        log.info("the message store's budget is %d bytes of the pool, not store_budget_bytes=%d: no more fits beside "
                 "the work KV here", room, config.store_budget_bytes)
    return min(config.store_budget_bytes, room)


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
