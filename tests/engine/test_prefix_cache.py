"""Prefix caching across requests: a hit gives the tokens a miss gives, and reuses the cached KV's memory."""

import pytest
import torch

from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.engine.engine import KVTransform
from braid.engine.errors import StoreFullError

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
TASK = ("System: you are one of several workers. Read the records, find the one asked for, and answer "
        "with its value only. Records follow.")


@pytest.fixture(scope="module")
def engines(checkpoint):
    path = checkpoint("llama")
    return Engine(EngineConfig(path, prefix_block_tokens=4)), Engine(EngineConfig(path, prefix_caching=False))


def answer(eng: Engine, parents: list[str], header: str = "Assistant:") -> list[int]:
    out, = eng.decode([DecodeCall(header, parents=parents, sampling=GREEDY)])
    return list(eng.message(out).token_ids)


def test_a_repeated_prompt_shares_the_cached_kv_and_answers_the_same(engines):
    cached, plain = engines
    first, = cached.prefill([PrefillCall(TASK)])
    cached.free(first)  # the caller is done with it; the cache keeps its KV
    used = cached.store.used_bytes
    hits = cached.prefix_cache.hits
    again, = cached.prefill([PrefillCall(TASK)])
    assert cached.prefix_cache.hits == hits + 1 and cached.store.used_bytes == used  # no new KV
    want, = plain.prefill([PrefillCall(TASK)])
    torch.testing.assert_close(cached.message(again).kv.read(), plain.message(want).kv.read(), rtol=0, atol=0)
    ctx = "records: ann lima; bob oslo. who: bob"
    c1, = cached.prefill([PrefillCall(ctx, parents=[again])])
    c2, = plain.prefill([PrefillCall(ctx, parents=[want])])
    assert answer(cached, [again, c1]) == answer(plain, [want, c2])


def test_a_shared_start_is_reused_in_whole_blocks(engines):
    cached, plain = engines
    head = "User: the same long opening words shared by both of these two prompts, then"
    cached.prefill([PrefillCall(head + " one ending.")])
    reused = cached.prefix_cache.reused_tokens
    prompt = head + " a different ending here."
    got, = cached.prefill([PrefillCall(prompt)])
    want, = plain.prefill([PrefillCall(prompt)])
    n = cached.prefix_cache.reused_tokens - reused
    shared = next(i for i, (a, b) in enumerate(zip(cached.tokenize(head + " one ending."), cached.tokenize(prompt)))
                  if a != b)
    assert n == shared // 4 * 4 and n > 0  # the whole 4-token blocks of the common start
    assert cached.message(got).token_ids == plain.message(want).token_ids
    torch.testing.assert_close(cached.message(got).kv.read(), plain.message(want).kv.read(), rtol=1e-5, atol=1e-5)
    assert answer(cached, [got]) == answer(plain, [want])
    # a decode header starting with a cached prompt reuses it too, and decodes the same
    hits = cached.prefix_cache.hits
    assert answer(cached, [], prompt + " Assistant:") == answer(plain, [], prompt + " Assistant:")
    assert cached.prefix_cache.hits == hits + 1
    assert not any(m.startswith("~prefix-") for m in cached.store.ids())  # lent views are returned


def test_no_hit_across_different_context_or_position(engines):
    cached, _ = engines
    a, = cached.prefill([PrefillCall("User: first history.")])
    b, = cached.prefill([PrefillCall("User: another history.")])
    text = "Assistant: the same words after each history."
    after_a, = cached.prefill([PrefillCall(text, parents=[a])])
    hits = cached.prefix_cache.hits
    after_b, = cached.prefill([PrefillCall(text, parents=[b])])
    moved, = cached.prefill([PrefillCall(text, parents=[a], new_offset=40)])
    assert cached.prefix_cache.hits == hits  # what came before differs, or where it starts
    assert not torch.equal(cached.message(after_a).kv.read(), cached.message(after_b).kv.read())
    # imported KV (encoded elsewhere, in a context this engine never saw) is never a cache key
    m = cached.message(a)
    imported = cached.import_message(m.token_ids, m.kv.read().clone(), m.offset, cached.fingerprint)
    assert cached.message(imported).content_key is None
    cached.prefill([PrefillCall(text, parents=[imported])])
    assert cached.prefix_cache.hits == hits


def test_the_cache_yields_to_the_store_budget(checkpoint):
    path = checkpoint("llama")
    # (dense: each cached copy its own tensor of the whole message; a paged one shares its cached start's blocks)
    probe = Engine(EngineConfig(path, prefix_caching=False, kv_home="dense"))
    one, = probe.prefill([PrefillCall(TASK)])
    eng = Engine(EngineConfig(path, store_budget_bytes=3 * probe.message(one).held_bytes, kv_home="dense"))
    for i in range(6):  # each leaves a cached copy behind: the store evicts the oldest to fit the next
        mid, = eng.prefill([PrefillCall(f"{TASK} Case {i}.")])
        eng.free(mid)
    assert eng.store.used_bytes <= eng.config.store_budget_bytes and eng.store.evictions > 0
    mid, = eng.prefill([PrefillCall(f"{TASK} Case 0.")])  # evicted: encoded again, correctly
    torch.testing.assert_close(eng.message(mid).kv.read(0, 10), probe.message(one).kv.read(0, 10))
    assert eng.clear_prefix_cache() > 0 and eng.store.used_bytes == eng.message(mid).held_bytes


def test_a_failed_call_leaves_no_cached_message_and_mapped_calls_are_not_cached(engines, checkpoint):
    cached, _ = engines
    per_token = cached.spec.num_layers * 2 * cached.spec.num_kv_heads * cached.spec.head_dim * 4
    small = Engine(EngineConfig(checkpoint("llama"), prefix_block_tokens=4, kv_budget_bytes=200 * per_token))
    small.prefill([PrefillCall(TASK)])
    kept = set(small.store.ids())
    with pytest.raises(StoreFullError):  # TASK is found whole; the long one can never fit: the call fails whole
        small.prefill([PrefillCall(TASK), PrefillCall(" ".join(["word"] * 400))])
    assert set(small.store.ids()) == kept
    # a header whose start is cached, decoded while its KV is read as it grows, as a worker ships it
    stream = cached.decode_stream([DecodeCall(TASK + " Assistant:", sampling=GREEDY)], readable=True)
    events = iter(stream)
    next(events)
    n = stream.encoded(0)
    tokens, kv = stream.partial_kv(0, 0, n)
    for _ in events:
        pass
    msg = cached.message(stream.ids[0])
    assert n > len(cached.tokenize(TASK)) and tokens == list(msg.token_ids[:n])
    torch.testing.assert_close(kv, msg.kv.read(0, n))
    # a call whose parents' KV a mapper changes is neither a hit nor cached
    hits, entries = cached.prefix_cache.hits, len(cached.prefix_cache)
    task, = cached.prefill([PrefillCall(TASK)])
    mapped = cached.decode_stream([DecodeCall(" Assistant:", parents=[task], sampling=GREEDY)],
                                  transform=KVTransform(frozenset([task]), lambda msg, kv: kv))
    list(mapped)
    assert cached.prefix_cache.hits == hits + 1  # (the prefill above; the mapped decode itself looks nothing up)
    assert cached.message(mapped.ids[0]).content_key is None and len(cached.prefix_cache) == entries
