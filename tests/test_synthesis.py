"""Parallel-Synthesis (Algorithm 1): placement, exactness where it must hold, and the mapper/adapter seams."""

from contextlib import contextmanager

import torch

from braid.engine import DecodeCall, PrefillCall, SamplingParams
from braid.engine.synthesis import Placement, SynthesisHooks, place_branches, synthesize, synthesize_stream, synthesize_text
from braid.kernels import rerotate_keys_torch

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def workflow(eng, contexts):
    """A shared prefix, one branch context per worker, and the workers' outputs decoded in parallel."""
    prefix = eng.prefill([PrefillCall("User: add the partial results of all workers.")])
    ctx = eng.prefill([PrefillCall(c, parents=prefix) for c in contexts])
    branches = eng.decode([DecodeCall("Worker:", parents=[*prefix, c], sampling=SamplingParams(
        max_tokens=6 + 3 * j, ignore_eos=True)) for j, c in enumerate(ctx)])
    return prefix, branches


def test_place_branches():
    assert place_branches(10, [3, 5, 2], Placement.BRANCH_POINT) == ([10, 10, 10], 15)
    assert place_branches(10, [3, 5, 2], "sequential") == ([10, 13, 18], 20)


def test_chained_branches_sequential_equals_text(family_engine):
    """Each branch encoded right after the previous ones: the cache path is exact, not approximate."""
    eng = family_engine
    prefix = eng.prefill([PrefillCall("User: add the partial results.")])
    chain = []
    for text in ["Worker one: 3 + 4 = 7", "Worker two: 5", "Worker three: 1 2 3"]:
        chain += eng.prefill([PrefillCall(text, parents=[*prefix, *chain])])
    cached = synthesize(eng, chain, "Synthesizer:", prefix=prefix, placement=Placement.SEQUENTIAL,
                        sampling=GREEDY)
    text = synthesize_text(eng, chain, "Synthesizer:", prefix=prefix, sampling=GREEDY)
    assert eng.message(cached).token_ids[-GREEDY.max_tokens:] == eng.message(text).token_ids[-GREEDY.max_tokens:]
    assert eng.message(cached).offset == eng.message(chain[-1]).end  # prompt right after the last branch
    assert eng.message(text).parents == tuple(prefix)  # the text path reuses the prefix's KV


def test_branch_point_reencodes_each_branch(llama_engine):
    eng = llama_engine
    prefix, branches = workflow(eng, ["Worker one: you get 3.", "Worker two, a longer context: you get 4 and 5."])
    n = eng.message(prefix[0]).num_tokens
    assert [eng.message(b).offset for b in branches] != [n, n]  # they sit after different contexts
    seen = {}

    def mapper(kv, *, branch, num_branches):
        seen[branch] = (kv.clone(), num_branches)
        return kv

    out = synthesize(eng, branches, "Synthesizer:", prefix=prefix, sampling=GREEDY,
                     hooks=SynthesisHooks(mapper=mapper))
    for j, b in enumerate(branches):
        msg = eng.message(b)
        delta = torch.full((msg.num_tokens,), n - msg.offset, dtype=torch.long)
        placed, m = seen[j]
        assert m == 2
        assert (placed[:, 0] - rerotate_keys_torch(msg.kv[:, 0], delta, eng.lm.inv_freq)).abs().max() < 1e-6
        assert torch.equal(placed[:, 1], msg.kv[:, 1])
    longest = max(eng.message(b).num_tokens for b in branches)
    assert eng.message(out).offset == n + longest
    plain = synthesize(eng, branches, "Synthesizer:", prefix=prefix, sampling=GREEDY)
    assert eng.message(plain).token_ids == eng.message(out).token_ids  # identity mapper changes nothing


def test_placements_and_naive_reuse_differ(llama_engine):
    """Placement is a real choice: the same branches placed differently give different synthesizer KV."""
    eng = llama_engine
    prefix, branches = workflow(eng, ["Context A.", "A much longer context for worker B, with more words."])
    at_branch_point = synthesize(eng, branches, "Synthesizer:", prefix=prefix, sampling=GREEDY)
    sequential = synthesize(eng, branches, "Synthesizer:", prefix=prefix, placement="sequential", sampling=GREEDY)
    kv_a, kv_b = eng.message(at_branch_point).kv, eng.message(sequential).kv
    assert eng.message(at_branch_point).offset != eng.message(sequential).offset
    assert (kv_a[:, 1] - kv_b[:, 1]).abs().max() > 1e-4


def test_mapper_and_adapter_plug_in(llama_engine):
    eng = llama_engine
    prefix, branches = workflow(eng, ["Context A.", "Context B."])
    entered = []

    @contextmanager
    def adapter():
        entered.append("in")
        yield
        entered.append("out")

    def silence_values(kv, *, branch, num_branches):
        out = kv.clone()
        out[:, 1] = 0
        return out

    stream = synthesize_stream(eng, branches, "Synthesizer:", prefix=prefix, sampling=GREEDY,
                               hooks=SynthesisHooks(mapper=silence_values, adapter=adapter))
    events = list(stream)
    # the scheduler enters the adapter around each of the call's forwards: the header's, then one per token
    assert entered == ["in", "out"] * (1 + GREEDY.max_tokens) and len(events) == GREEDY.max_tokens
    plain = synthesize(eng, branches, "Synthesizer:", prefix=prefix, sampling=GREEDY)
    # the mapper's output is what the synthesizer attended to
    assert (eng.message(stream.ids[0]).kv - eng.message(plain).kv).abs().max() > 1e-4
    for b in branches:  # and the stored branches were not touched
        assert eng.message(b).kv[:, 1].abs().max() > 0
