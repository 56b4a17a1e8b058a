"""Bad input raises an error naming the offending value, and leaves the store exactly as it was."""

import pytest
import torch

from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.engine.errors import (
    BraidError,
    ContextOverflowError,
    EmptyHeaderError,
    FingerprintMismatchError,
    InvalidOffsetError,
    StoreFullError,
    UnknownMessageError,
)


def snapshot(eng):
    return eng.store.ids(), eng.store.used_bytes, {m: eng.message(m).kv.read().clone() for m in eng.store.ids()}


def assert_unchanged(eng, before):
    ids, used, tensors = snapshot(eng)
    assert ids == before[0] and used == before[1]
    assert all(torch.equal(tensors[m], before[2][m]) for m in ids)


@pytest.fixture
def populated(fresh_engine):
    eng = fresh_engine
    a, b = eng.prefill([PrefillCall("User: What is the capital of France?"), PrefillCall("0 1 2 3")])
    return eng, a, b


def bad_calls(eng, a, b, foreign):
    limit = eng.spec.max_positions
    n = eng.message(a).num_tokens
    return [
        (UnknownMessageError, "nope", lambda: eng.decode([DecodeCall("A:", parents=[a, "nope"])])),
        (UnknownMessageError, "gone", lambda: eng.prefill([PrefillCall("x", parents=["gone"])])),
        (FingerprintMismatchError, foreign, lambda: eng.decode([DecodeCall("A:", parents=[foreign])])),
        (InvalidOffsetError, "-3", lambda: eng.decode([DecodeCall("A:", parents=[a], offsets=[-3])])),
        (InvalidOffsetError, str(limit - 1), lambda: eng.prefill([PrefillCall("x", parents=[a],
                                                                             offsets=[limit - 1])])),
        (InvalidOffsetError, "2 offsets", lambda: eng.prefill([PrefillCall("x", parents=[a], offsets=[0, 5])])),
        (InvalidOffsetError, "-1", lambda: eng.prefill([PrefillCall("x", new_offset=-1)])),
        (EmptyHeaderError, "header is empty", lambda: eng.decode([DecodeCall("", parents=[a])])),
        (EmptyHeaderError, "call 1", lambda: eng.decode([DecodeCall("A:"), DecodeCall([], parents=[b])])),
        (BraidError, "message is empty", lambda: eng.prefill([PrefillCall("")])),
        (BraidError, "99999", lambda: eng.prefill([PrefillCall([5, 99999])])),
        (ContextOverflowError, str(limit), lambda: eng.decode([DecodeCall("A:", parents=[a], sampling=SamplingParams(
            max_tokens=limit))])),
        (ContextOverflowError, "exceeds", lambda: eng.prefill([PrefillCall("x", new_offset=limit)])),
        (ContextOverflowError, str(limit - n), lambda: eng.decode([DecodeCall("A:", parents=[a], new_offset=limit - n)])),
        (BraidError, "no calls", lambda: eng.decode([])),
    ]


def test_bad_input_is_rejected_and_store_unchanged(populated, checkpoint):
    eng, a, b = populated
    other = Engine(EngineConfig(checkpoint("llama", seed=1)))  # same shapes, other weights
    assert other.fingerprint != eng.fingerprint
    foreign, = other.prefill([PrefillCall("User: hi")])
    eng.store.add([other.message(foreign)])  # a message that reached this store by mistake
    before = snapshot(eng)
    for error, needle, call in bad_calls(eng, a, b, foreign):
        with pytest.raises(error, match=needle):
            call()
        assert_unchanged(eng, before)
    # the engine keeps serving afterwards
    ok, = eng.decode([DecodeCall("A:", parents=[a, b], sampling=SamplingParams(max_tokens=3))])
    assert eng.message(ok).parents == (a, b)


def test_store_full_during_decode_leaves_store_unchanged(populated):
    eng, a, b = populated
    eng.store.budget_bytes = eng.store.used_bytes + 1  # room for nothing new
    before = snapshot(eng)
    with eng.store.pinned([a, b]):
        with pytest.raises(StoreFullError):
            eng.decode([DecodeCall("A:", parents=[a], sampling=SamplingParams(max_tokens=4))])
    assert_unchanged(eng, before)


def test_lru_eviction_through_the_engine(fresh_engine):
    eng = fresh_engine
    first, = eng.prefill([PrefillCall([5, 6, 7])])
    eng.store.budget_bytes = 2 * eng.message(first).held_bytes  # room for two 3-token messages (a block each, paged)
    second, = eng.prefill([PrefillCall([8, 9, 10])])
    third, = eng.prefill([PrefillCall([11, 12, 13], parents=[second])])  # second is pinned while in use
    assert first not in eng.store and second in eng.store and third in eng.store
    with pytest.raises(UnknownMessageError, match=first):
        eng.text(first)
