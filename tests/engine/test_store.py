"""Message store: byte accounting, LRU eviction of unpinned messages, explicit free, atomic inserts."""

import pytest
import torch

from braid.engine.errors import MessageInUseError, StoreFullError, UnknownMessageError
from braid.engine.store import DenseKV, Message, MessageStore


def msg(mid, tokens=4):
    kv = torch.zeros(2, 2, 1, tokens, 8)  # 4 bytes * 2*2*1*tokens*8 = 128 * tokens
    return Message(mid, tuple(range(tokens)), DenseKV(kv), 0, (), (), "fp")


def test_byte_accounting_and_free():
    store = MessageStore(budget_bytes=10_000)
    store.add([msg("a"), msg("b", 8)])
    assert store.used_bytes == 128 * 4 + 128 * 8 and len(store) == 2
    store.free("a")
    assert store.used_bytes == 128 * 8 and "a" not in store
    with pytest.raises(UnknownMessageError, match="'a'"):
        store.free("a")


def test_lru_eviction_skips_pinned_and_recent():
    store = MessageStore(budget_bytes=128 * 12)
    store.add([msg("a"), msg("b"), msg("c")])
    store.touch(["a"])  # order now b, c, a
    with store.pinned(["b"]):
        store.add([msg("d")])  # needs 512 bytes: evicts c (b is pinned)
    assert store.ids() == ["b", "a", "d"] and store.evictions == 1
    store.add([msg("e")])  # b is no longer pinned: it is the LRU victim
    assert store.ids() == ["a", "d", "e"]


def test_failed_insert_changes_nothing():
    store = MessageStore(budget_bytes=128 * 8)
    store.add([msg("a"), msg("b")])
    with store.pinned(["a", "b"]):
        with pytest.raises(StoreFullError, match="in use"):
            store.add([msg("c")])
        with pytest.raises(MessageInUseError):
            store.free("a")
    with pytest.raises(StoreFullError, match="exceed the store budget"):
        store.add([msg("big", 100)])
    assert store.ids() == ["a", "b"] and store.used_bytes == 128 * 8 and store.evictions == 0


def test_free_when_unpinned_waits_for_the_last_user():
    store = MessageStore(budget_bytes=10_000)
    store.add([msg("a")])
    pins = store.pin(["a"])
    store.free("a", when_unpinned=True)
    assert "a" in store  # still in use
    store.unpin(pins)
    assert "a" not in store and store.used_bytes == 0


def test_held_messages_are_not_evicted_but_can_be_freed():
    store = MessageStore(budget_bytes=128 * 8)
    store.add([msg("a"), msg("b")])
    held = store.hold(["a"])
    store.add([msg("c")])  # needs room: b goes, a is held
    assert store.ids() == ["a", "c"]
    store.free("a")  # its owner may still free it
    store.release(held)
    assert store.ids() == ["c"]


def test_kv_is_a_handle_read_exactly_and_counted_once_with_its_parts():
    """A message holds its KV as a handle, never a tensor; a part's read is the original's slice, bit for bit,
    over the same memory; and the store counts that memory once, however many messages hold parts of it."""
    t = torch.randn(2, 2, 1, 10, 8)
    with pytest.raises(TypeError, match="handle"):
        Message("raw", tuple(range(10)), t, 0, (), (), "fp")
    with pytest.raises(TypeError):
        DenseKV(torch.zeros(2, 3, 1, 10, 8))
    kv = DenseKV(t)
    assert kv.read() is t and kv.part(0, 10) is kv and kv.num_tokens == 10 and kv.nbytes == t.numel() * 4
    assert torch.equal(kv.read(3, 7), t[:, :, :, 3:7]) and torch.equal(kv.read(4), t[:, :, :, 4:])
    assert kv.read(0, 0).shape == (2, 2, 1, 0, 8)
    keys, values = kv.keys_values()  # (apart: views, no copy)
    assert torch.equal(keys, t[:, 0]) and torch.equal(values, t[:, 1]) and keys.data_ptr() == t.data_ptr()
    part = kv.part(2, 9)
    assert part.num_tokens == 7 and torch.equal(part.read(), t[:, :, :, 2:9])
    assert torch.equal(part.read(1, 3), t[:, :, :, 3:5])
    assert part.read().data_ptr() == t[:, :, :, 2:9].data_ptr()  # a view: no copy
    assert part.storage == kv.storage == (t.untyped_storage().data_ptr(), t.numel() * 4)
    assert part.key == kv.part(2, 9).key != kv.key and part.nbytes == 7 * 2 * 2 * 8 * 4
    for bad in ((-1, 3), (5, 4), (0, 11)):
        with pytest.raises(IndexError):
            kv.read(*bad)
    store = MessageStore(budget_bytes=10_000)
    whole = Message("whole", tuple(range(10)), kv, 0, (), (), "fp")
    view = Message("view", tuple(range(2, 9)), part, 2, ("whole",), (0,), "fp")
    store.add([whole, view, Message("again", tuple(range(10)), kv.part(0), 0, (), (), "fp")])
    assert store.used_bytes == t.numel() * 4
    store.free("whole")
    store.free("again")
    assert store.used_bytes == t.numel() * 4  # the view still holds the memory
    store.free("view")
    assert store.used_bytes == 0
