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

import torch

from braid.engine.call import Adapter, Call, DecodeCall, KVTransform, PrefillCall, Sibling, TokenEvent, Tokens
from braid.engine.committer import CACHED_PREFIX, Committer
from braid.engine.config import EngineConfig
from braid.engine.cuda_graphs import DecodeGraphs
from braid.engine.errors import BraidError, FingerprintMismatchError, InvalidOffsetError
from braid.engine.host import to_device
from braid.engine.kv_cache import KVPool
from braid.engine.model import LoadedModel, load_model
from braid.engine.model_runner import ModelRunner
from braid.engine.planner import Planner
from braid.engine.prefix_cache import PrefixCache
from braid.engine.scheduler import Request, RequestStatus, Scheduler
from braid.engine.store import DenseKV, Message, MessageStore, new_message_id
from braid.engine.threads import one_thread

__all__ = ["CACHED_PREFIX", "Call", "DecodeCall", "DecodeStream", "Engine", "KVTransform", "PrefillCall", "Sibling",
           "TokenEvent", "Tokens"]  # (the request types live in engine.call; imported from here too)
log = logging.getLogger(__name__)


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
        self.ids: list[str] | None = None

    @property
    def timings(self) -> dict[str, float]:
        return self._request.timings

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
            interpreted = os.environ.get("TRITON_INTERPRET") == "1"
            if config.attention == "paged" and self.lm.device.type != "cuda" and not interpreted:
                raise ValueError("attention paged runs a Triton kernel: on CUDA, or on CPU only under Triton's "
                                 "interpreter (TRITON_INTERPRET=1 before triton is imported, as the tests run it)")
            self.runner = ModelRunner(self.lm, config.attention, config.compile)
            self.lock = threading.RLock()
            self._store_lock = threading.Lock()
            self.prefix_cache = PrefixCache(config.prefix_block_tokens) if config.prefix_caching else None
            self.adapters: dict[str, Adapter] = {}  # what calls may name as their adapter (add_adapter)
            # the calibration attached to it (methods.calibration.attach, which adds its adapters; None: none): held
            # here, opaque to the core, which imports no method
            self.calibration: object | None = None
            self.kv_bytes_per_token = self.lm.kv_bytes_per_token
            work = max(1, _kv_budget(config, self.lm.device) // self.kv_bytes_per_token // config.kv_block_tokens)
            stored = self.store.budget_bytes // self.kv_bytes_per_token // config.kv_block_tokens if self.paged else 0
            self.scheduler = Scheduler(self.runner, config.max_batched_tokens,
                                       KVPool(self.lm, work + stored, config.kv_block_tokens, work,
                                              zeroed=self.runner.in_place),
                                       config.max_running_requests, name=self.fingerprint[:8],
                                       mix_adapters=config.mix_adapters,
                                       threads=_cpu_threads(config, self.lm, caller_threads), adapters=self.adapters,
                                       overlap=config.overlap)
            graphs = config.decode_graphs
            if not self.runner.in_place and (graphs == "eager" or (graphs == "auto" and self.lm.device.type == "cuda")):
                self.runner.graphs = DecodeGraphs(self.runner, self.scheduler.pool, capture=graphs == "auto")
            # the request's way through: planned here (planner), run by the scheduler, which calls the committer
            # through each request's PlannedKV (engine.scheduler.RequestKV) to place its parents and store its messages
            self.planner = Planner(config, self.spec, self.fingerprint, self.tokenize, self.store,
                                   self.prefix_cache, self.adapters)
            self.committer = Committer(config, self.lm, self.scheduler.pool, self.store, self._store_lock,
                                       self.prefix_cache, self.tokenizer, self.paged)
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
        return self.committer.encoded_by(adapter_id)

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
        copies = [self.committer.placed_copy(p, o) for p, o in parents]
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
    def prefill(self, calls: Sequence[PrefillCall], transform: KVTransform | None = None) -> list[str]:
        """Encode each call's message (all in one request); each message stays contiguous. A message found in
        the prefix cache whole is not encoded again: it shares the cached KV. Returns the stored calls' ids.

        Unstored calls may come first: encoded in the same forwards, before the others, which read one by naming
        `Sibling(i)` among their parents (a context that is encoded again only to be read, never kept).
        `transform`: the stored calls read its parents mapped, the unstored ones unmapped, as a decode request's
        calls do (decode_stream): a decoded message encoded again from its tokens through the same seam."""
        request, ready = self._submit(calls, transform)
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
        return [ready[c] if c in ready else next(encoded) for c in range(len(calls)) if calls[c].store]

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
        if calls and not any(isinstance(c, DecodeCall) for c in calls):  # (no calls at all: Planner.check says so)
            raise BraidError("a decode request needs at least one DecodeCall")
        request, _ = self._submit(calls, transform, grows=self.config.kv_on_demand and not readable)
        return DecodeStream(request, self.store)

    # ---- internals ------------------------------------------------------------------------------

    def _submit(self, calls: Sequence[PrefillCall | DecodeCall], transform: KVTransform | None,
                grows: bool = False) -> tuple[Request | None, dict[int, str]]:
        """Validate and plan in the caller's thread (errors surface here), reuse what the prefix cache holds,
        pin the parents, hand the rest to the scheduler. Returns the request (None: nothing left to encode)
        and the ids of prefill calls found whole in the cache, by call index."""
        lead = self.planner.check(calls)
        with self._store_lock:
            plan = self.planner.plan(calls, lead, transform.ids if transform is not None else ())
            ready: dict[int, str] = {}
            views: list[str] = []
            # A mapped or adapted call's KV is not what the base model gives for the same content: not cached;
            # nor is a call that reads its siblings (no stored content to key it by).
            if self.prefix_cache is not None and transform is None and not lead \
                    and all(c.adapter is None for c in calls):
                plan, ready, views = self.planner.reuse(plan)
            pins = self.store.pin(plan.parent_ids if plan is not None else ())
        work = self.committer.request_kv(plan, transform, pins, views)
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
