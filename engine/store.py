"""The message store: encoded messages with their KV, under a byte budget with LRU eviction.

Messages may share KV memory (a prefix-cache hit is a new message over the same tensor): bytes are
counted once per tensor storage, and freed when its last message goes."""

import secrets
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from braid.engine.errors import MessageInUseError, StoreFullError, UnknownMessageError


def new_message_id() -> str:
    return secrets.token_hex(12)  # unguessable: ids double as capabilities in the cluster


@dataclass(eq=False)
class Message:
    id: str
    token_ids: tuple[int, ...]
    kv: torch.Tensor  # [layers, 2 (k, v), kv_heads, tokens, head_dim]; keys rotated to `positions`
    offset: int  # logical position of the first token
    parents: tuple[str, ...]
    parent_offsets: tuple[int, ...]
    fingerprint: str
    content_key: bytes | None = None  # what its KV is a function of (engine.prefix_cache); None: not cacheable

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
        return self.kv.numel() * self.kv.element_size()

    @property
    def storage(self) -> tuple[int, int]:
        """(address, bytes) of the memory its KV lives in, which other messages may share."""
        st = self.kv.untyped_storage()
        return st.data_ptr(), st.nbytes()


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
        new_storage = {m.storage[0]: m.storage[1] for m in messages if m.storage[0] not in self._storage_refs}
        need = sum(new_storage.values())
        if need > self.budget_bytes:
            raise StoreFullError(f"{need} bytes of new KV exceed the store budget of {self.budget_bytes} bytes")
        victims, freed, leaving = [], 0, Counter()
        for mid, msg in self._messages.items():
            if self.used_bytes - freed + need <= self.budget_bytes:
                break
            if not self._pins[mid] and not self._held[mid]:
                victims.append(mid)
                ptr, size = msg.storage
                leaving[ptr] += 1
                freed += size if leaving[ptr] == self._storage_refs[ptr] else 0
        if self.used_bytes - freed + need > self.budget_bytes:
            raise StoreFullError(f"store full: {self.used_bytes} of {self.budget_bytes} bytes used, mostly by "
                                 f"messages in use; {need} more needed")
        for mid in victims:
            self._remove(mid)
            self.evictions += 1
        for msg in messages:
            self._messages[msg.id] = msg
            ptr, size = msg.storage
            self.used_bytes += size if not self._storage_refs[ptr] else 0
            self._storage_refs[ptr] += 1

    def free(self, message_id: str, when_unpinned: bool = False) -> None:
        self.get(message_id)
        if self._pins[message_id]:
            if when_unpinned:
                self._doomed.add(message_id)
                return
            raise MessageInUseError(f"message {message_id!r} is in use by a running call and cannot be freed")
        self._remove(message_id)

    def _remove(self, message_id: str) -> None:
        ptr, size = self._messages.pop(message_id).storage
        self._storage_refs[ptr] -= 1
        if not self._storage_refs[ptr]:
            del self._storage_refs[ptr]
            self.used_bytes -= size
