"""The message store: encoded messages with their KV, under a byte budget with LRU eviction.

A message's KV is an opaque handle: everything outside this module reads it through the handle's few methods. A
DenseKV is a tensor of its own (a message shipped in, or any message under `kv_home="dense"`); a PagedKV lives in
the engine's KV pool (engine.kv_cache.KVPool), in the blocks the call that made it wrote it to, so that storing
it copies nothing and a call that reads it where it was encoded reads it in place. Messages may share KV memory (a
prefix-cache hit or a view is a new message over part of another's KV; the messages of one request share their
blocks): bytes are counted once per memory they live in, and freed when its last message goes."""

import secrets
import threading
from collections import Counter, OrderedDict
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from braid.engine.errors import MessageInUseError, StoreFullError, UnknownMessageError


def new_message_id() -> str:
    return secrets.token_hex(12)  # unguessable: ids double as capabilities in the cluster


def _span(n: int, start: int, end: int | None) -> tuple[int, int]:
    """[start, end) of a handle's n tokens (end None: to the last), checked."""
    end = n if end is None else end
    if not 0 <= start <= end <= n:
        raise IndexError(f"KV tokens [{start}, {end}) are out of range: it holds {n}")
    return start, end


class DenseKV:
    """A message's KV in one tensor [layers, 2 (k, v), kv_heads, tokens, head_dim], keys rotated to the message's
    positions. Immutable: callers read it, never write to what `read` returns."""

    __slots__ = ("_kv",)

    def __init__(self, kv: torch.Tensor):
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[1] != 2:  # (pool: KVPool, when paged)
            raise TypeError(f"DenseKV holds a tensor [layers, 2, kv_heads, tokens, head_dim], not "
                            f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}")
        self._kv = kv

    def __repr__(self) -> str:
        return f"DenseKV({tuple(self._kv.shape)}, {self._kv.dtype}, {self._kv.device})"

    @property
    def num_tokens(self) -> int:
        return self._kv.shape[3]

    def _range(self, start: int, end: int | None) -> tuple[int, int]:
        return _span(self._kv.shape[3], start, end)

    def read(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Tokens [start, end) (default: all) as a tensor [L, 2, H, end - start, D]: a view, no copy; the stored
        tensor itself for the whole range (callers may test identity to know it is not a copy)."""
        start, end = self._range(start, end)
        return self._kv if start == 0 and end == self._kv.shape[3] else self._kv[:, :, :, start:end]

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All its keys and values [L, H, T, D], apart: views, no copy."""
        return self._kv[:, 0], self._kv[:, 1]

    def copy(self) -> torch.Tensor:
        """All its KV [L, 2, H, T, D] as a new tensor of the caller's own."""
        return self._kv.clone()

    def part(self, start: int, end: int | None = None) -> "DenseKV":
        """A handle over tokens [start, end) sharing this one's memory (a view or a prefix-cache hit); itself for
        the whole range."""
        start, end = self._range(start, end)
        return self if start == 0 and end == self._kv.shape[3] else DenseKV(self._kv[:, :, :, start:end])

    @property
    def nbytes(self) -> int:
        """Bytes of its own tokens' KV (a part counts its tokens only)."""
        return self._kv.numel() * self._kv.element_size()

    @property
    def storage(self) -> tuple[int, int]:
        """(address, bytes) of the memory it lives in, which other handles (its parts) may share: what the
        store counts once."""
        st = self._kv.untyped_storage()
        return st.data_ptr(), st.nbytes()

    @property
    def key(self) -> tuple:
        """What tells this KV from any other live one (engine.kv_cache.KVPool.share_key): its address and
        layout, equal for two handles over the same tokens of the same memory."""
        kv = self._kv
        return kv.data_ptr(), tuple(kv.shape), kv.stride(), kv.dtype, kv.device

    @property
    def storages(self) -> list[tuple[int, int, "DenseKV"]]:
        """[(key, bytes, owner)] of the memory it lives in (the store counts each key once, and tells its owner
        to `release` when its last message goes)."""
        return [(*self.storage, self)]

    def release(self) -> None:
        """(The store, when the last message over this memory goes: a tensor's memory goes with its last
        reference; nothing to hand back.)"""


class PagedAlloc:
    """Blocks of a KV pool that stored messages hold: the pool keeps them from the free list until `release`.
    The messages one request stored share one (and so do views and prefix-cache hits over them). A reader that
    holds a message outside the store's lock (a transport shipping it, a trainer reading a context) reads it
    `reading()`: blocks let go meanwhile go back to the pool once the last such read is done, and a read after
    they were let go is refused, never served from blocks another call may have written since."""

    __slots__ = ("pool", "blocks", "held", "_readers", "_lock")

    def __init__(self, pool, blocks: list[int]):
        self.pool, self.blocks, self.held, self._readers = pool, list(blocks), True, 0
        self._lock = threading.Lock()
        pool.hold(self.blocks)

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.pool.block_tokens * self.pool.slot_bytes

    @contextmanager
    def reading(self):
        """Its blocks kept for the reads made inside (UnknownMessageError if they were let go already)."""
        with self._lock:
            if not self.held:
                raise UnknownMessageError("the message's KV was freed or evicted while it was being read")
            self._readers += 1
        try:
            yield
        finally:
            with self._lock:
                self._readers -= 1
                last = not self._readers and not self.held
            if last:
                self.pool.unhold(self.blocks)

    def release(self) -> None:
        """Let the blocks go (once): the pool frees those no running call, no other allocation and no read in
        progress holds."""
        with self._lock:
            if not self.held:
                return
            self.held = False
            if self._readers:  # (the last read hands them back)
                return
        self.pool.unhold(self.blocks)


class PagedKV:
    """A message's KV in the engine's KV pool: its tokens' slots there ([T] pool slots, keys rotated to the
    message's positions), in blocks its PagedAlloc holds. Reading gathers (a copy); a call that reads the message
    at the offset it was encoded at reads its slots in place (engine.kv_cache.WorkCache.reference_slots)."""

    __slots__ = ("allocs", "index")

    def __init__(self, allocs: tuple[PagedAlloc, ...], index: torch.Tensor):
        """`allocs`: the allocations its slots lie in (a message encoded after a cached start spans the start's and
        its own)."""
        if index.dim() != 1 or index.dtype != torch.long:
            raise TypeError(f"PagedKV takes a 1-D long tensor of pool slots, not {index.dim()}-D {index.dtype}")
        self.allocs, self.index = tuple(allocs), index

    @property
    def pool(self):
        return self.allocs[0].pool

    def __repr__(self) -> str:
        return f"PagedKV({self.num_tokens} tokens in {sum(len(a.blocks) for a in self.allocs)} blocks)"

    @property
    def num_tokens(self) -> int:
        return self.index.numel()

    @property
    def blocks(self) -> list[int]:
        """The pool blocks its slots may lie in: those of its allocations."""
        return [b for a in self.allocs for b in a.blocks]

    def read(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Tokens [start, end) (default: all) as a tensor [L, 2, H, end - start, D]: gathered from the pool, a copy."""
        start, end = _span(self.num_tokens, start, end)
        with self._reading():
            return self.pool.kv.index_select(3, self.index[start:end])

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All its keys and values [L, H, T, D], apart: each gathered from the pool, a copy."""
        kv = self.pool.kv
        with self._reading():
            return kv[:, 0].index_select(2, self.index), kv[:, 1].index_select(2, self.index)

    @contextmanager
    def _reading(self):
        """Its allocations' blocks kept while it is read (PagedAlloc.reading)."""
        with ExitStack() as stack:
            for alloc in self.allocs:
                stack.enter_context(alloc.reading())
            yield

    def copy(self) -> torch.Tensor:
        """All its KV [L, 2, H, T, D] as a new tensor of the caller's own (gathered from the pool)."""
        return self.read()

    def part(self, start: int, end: int | None = None) -> "PagedKV":
        """A handle over tokens [start, end) in the same blocks (a view or a prefix-cache hit); itself when whole."""
        start, end = _span(self.num_tokens, start, end)
        return self if (start, end) == (0, self.num_tokens) else PagedKV(self.allocs, self.index[start:end])

    @property
    def nbytes(self) -> int:
        return self.num_tokens * self.pool.slot_bytes

    @property
    def storages(self) -> list[tuple[int, int, PagedAlloc]]:
        """[(an allocation's identity, the bytes of its blocks, the allocation)]: what the store counts once each."""
        return [(id(a), a.nbytes, a) for a in self.allocs]

    @property
    def key(self) -> tuple:
        return "paged", id(self.allocs[-1]), self.index.data_ptr(), self.num_tokens


@dataclass(eq=False)
class Message:
    id: str
    token_ids: tuple[int, ...]
    kv: "DenseKV | PagedKV"  # keys rotated to `positions`; read through the handle, never as a tensor
    offset: int  # logical position of the first token
    parents: tuple[str, ...]
    parent_offsets: tuple[int, ...]
    fingerprint: str
    content_key: bytes | None = None  # what its KV is a function of (engine.prefix_cache); None: not cacheable
    # What shaped its KV that this record does not name ("": nothing: its tokens, parents at their offsets, its
    # offset and the weights it was encoded by give its KV again, up to batching noise; else, e.g., a KV
    # transform's copies of its parents, which no later call can reproduce from the record)
    unrecorded: str = ""

    def __post_init__(self):
        if not isinstance(self.kv, (DenseKV, PagedKV)):
            raise TypeError(f"a message's KV is a handle (DenseKV or PagedKV), not {type(self.kv).__name__}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.offset, self.offset + self.num_tokens)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    @property
    def storages(self) -> list[tuple[int, int, object]]:
        """[(key, bytes, owner)] of the memory its KV lives in, which other messages may share."""
        return self.kv.storages

    @property
    def held_bytes(self) -> int:
        """Bytes of the memory its KV lives in (shared with the messages over the same memory)."""
        return sum(size for _, size, _ in self.storages)


class MessageStore:
    """Messages by id, least recently used first. Pinned messages are never evicted or freed."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._messages: OrderedDict[str, Message] = OrderedDict()
        self._pins: Counter[str] = Counter()
        self._storage_refs: Counter[int] = Counter()  # messages per KV storage
        self._doomed: set[str] = set()  # freed while in use: removed when the last call using them ends
        self._held: Counter[str] = Counter()  # kept from eviction (not from an explicit free) by their owner
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._messages)

    def __contains__(self, message_id: str) -> bool:
        return message_id in self._messages

    def ids(self) -> list[str]:
        """Ids in LRU order, least recently used first."""
        return list(self._messages)

    def get(self, message_id: str) -> Message:
        try:
            return self._messages[message_id]
        except KeyError:
            raise UnknownMessageError(f"unknown message id {message_id!r} (never stored, freed or evicted)") from None

    def pinned_count(self, message_id: str) -> int:
        return self._pins[message_id]

    def peek(self, message_id: str) -> Message | None:
        return self._messages.get(message_id)

    def touch(self, message_ids) -> None:
        for mid in message_ids:
            if mid in self._messages:
                self._messages.move_to_end(mid)

    def pin(self, message_ids) -> list[str]:
        """Keep these messages from being evicted or freed until `unpin` with the returned list."""
        ids = list(message_ids)
        self._pins.update(ids)
        return ids

    def hold(self, message_ids) -> list[str]:
        """Keep these messages from eviction until `release` with the returned list; their owner may still
        free them."""
        ids = list(message_ids)
        self._held.update(ids)
        return ids

    def release(self, ids: list[str]) -> None:
        self._held.subtract(ids)
        self._held += Counter()

    def unpin(self, ids: list[str]) -> None:
        self._pins.subtract(ids)
        self._pins += Counter()  # drop zero counts
        for mid in [m for m in self._doomed if not self._pins[m]]:
            self._doomed.discard(mid)
            if mid in self._messages:
                self._remove(mid)

    @contextmanager
    def pinned(self, message_ids):
        ids = self.pin(message_ids)
        try:
            yield
        finally:
            self.unpin(ids)

    def add(self, messages: list[Message]) -> None:
        """Insert all messages or none, evicting unpinned LRU messages as needed."""
        new = {key: size for m in messages for key, size, _ in m.storages if key not in self._storage_refs}
        kept = {key for m in messages for key, _, _ in m.storages}  # (memory they share with stored ones stays)
        need = sum(new.values())
        if need > self.budget_bytes:
            raise StoreFullError(f"{need} bytes of new KV exceed the store budget of {self.budget_bytes} bytes")
        victims, freed, leaving = [], 0, Counter()
        for mid, msg in self._messages.items():
            if self.used_bytes - freed + need <= self.budget_bytes:
                break
            if not self._pins[mid] and not self._held[mid]:
                victims.append(mid)
                for key, size, _ in msg.storages:
                    leaving[key] += 1
                    freed += size if leaving[key] == self._storage_refs[key] and key not in kept else 0
        if self.used_bytes - freed + need > self.budget_bytes:
            raise StoreFullError(f"store full: {self.used_bytes} of {self.budget_bytes} bytes used, mostly by "
                                 f"messages in use; {need} more needed")
        for msg in messages:  # (first: what they share with the victims is not let go)
            self._messages[msg.id] = msg
            for key, size, _ in msg.storages:
                self.used_bytes += size if not self._storage_refs[key] else 0
                self._storage_refs[key] += 1
        for mid in victims:
            self._remove(mid)
            self.evictions += 1

    def free(self, message_id: str, when_unpinned: bool = False) -> None:
        self.get(message_id)
        if self._pins[message_id]:
            if when_unpinned:
                self._doomed.add(message_id)
                return
            raise MessageInUseError(f"message {message_id!r} is in use by a running call and cannot be freed")
        self._remove(message_id)

    def _remove(self, message_id: str) -> None:
        msg = self._messages.pop(message_id)
        for key, size, owner in msg.storages:
            self._storage_refs[key] -= 1
            if not self._storage_refs[key]:
                del self._storage_refs[key]
                self.used_bytes -= size
                owner.release()  # (a paged message's blocks go back to the pool with the last message in them)
