"""The work KV (engine.kv_cache): the slots a step's builder claims for a request's rows, and a runner that only
reads them."""

import torch
from test_cuda_graphs import as_they_come, requests_over, release

from braid.engine import Engine, EngineConfig
from braid.engine.kv_cache import WorkCache


def test_claim_gives_the_rows_the_slots_after_the_cache_s_length_leading_rows_first(checkpoint):
    """WorkCache.claim: the other rows take the slots after the cache's length in order, tagged with their call's
    segment (entries + call); leading prefill rows, claimed ahead by reserve_lead, come first; `write` is each row's
    pool slot, `length` the cache's length with them."""
    eng = Engine(EngineConfig(checkpoint("llama")))
    pool = eng.scheduler.pool
    cache = WorkCache(eng.lm, 12, pool, pool.allocate(12))
    kv = torch.randn(*pool.kv.shape[:3], 3, pool.kv.shape[4])
    cache.append(*kv.to(pool.kv.dtype).unbind(1), segment=0)  # one entry: slots 0-2
    cache.reserve_lead(torch.tensor([1, 1]))  # a leading prefill call's two tokens (call 0: segment 1), slots 3-4
    calls = torch.tensor([0, 0, 1, 2])  # two leading rows, then one row each of calls 1 and 2
    slots = cache.claim(calls, entries=1, lead_rows=2)
    assert slots.lead == range(3, 5) and slots.own == range(5, 7) and slots.length == cache.length == 7
    assert slots.logical.tolist() == [3, 4, 5, 6] and torch.equal(slots.write, cache.index[slots.logical])
    assert cache.segment[:7].tolist() == [0, 0, 0, 1, 1, 2, 3]
    more = cache.claim(torch.tensor([2]), entries=1)  # the next step: after what is claimed
    assert more.logical.tolist() == [7] and more.lead == range(0) and more.length == 8
    pool.release(cache.blocks)


def test_the_runner_reads_its_step_and_writes_nothing_back(checkpoint):
    """A step handed to the runner twice gives the same logits bit for bit and leaves every request's cache and
    slots as they were: the runner claims nothing (the scheduler did, building the step) and sets nothing on its
    input; with several requests as with one, in the static forward as in the one as it comes."""
    eng = Engine(EngineConfig(checkpoint("llama"), decode_graphs="eager", kv_budget_bytes=64 << 20))
    for lengths, rows in (([9, 40, 21], [1, 2, 1]), ([33], [3])):
        for run in (eng.runner.step, lambda gs: as_they_come(eng, gs)):
            requests = requests_over(eng, lengths, rows, 4)
            before = [(g.cache.length, g.cache.claimed, {k: id(v) for k, v in vars(g).items()}) for g in requests]
            first, again = run(requests), run(requests)
            assert all(torch.equal(a, b) for a, b in zip(first, again))
            assert [(g.cache.length, g.cache.claimed, {k: id(v) for k, v in vars(g).items()}) for g in requests] == before
            release(eng, requests)
