"""Parallel-Synthesis (Algorithm 1): placement, exactness where it must hold, and the mapper/adapter seams."""

from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from braid.engine import DecodeCall, PrefillCall, SamplingParams
from braid.engine.engine import CACHED_PREFIX
from braid.engine.errors import BraidError
from braid.kernels import rerotate_keys_torch
from braid.methods.synthesis import (
    Placement,
    Refresh,
    SynthesisHooks,
    SynthesisMode,
    place_branches,
    read_from_text,
    synthesis_stream,
    synthesize,
    synthesize_stream,
    synthesize_text,
)

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
    # mixed: the branches encoded right after the prefix stay there, the others go end to end after the longest
    assert place_branches(10, [3, 5, 2], "mixed", [10, 10, 30]) == ([10, 10, 15], 17)
    assert place_branches(10, [3, 5, 2], "mixed", [10, 10, 10]) == place_branches(10, [3, 5, 2], "branch_point")
    assert place_branches(10, [3, 5, 2], "mixed", [14, 22, 30]) == place_branches(10, [3, 5, 2], "sequential")
    with pytest.raises(ValueError, match="own offset"):
        place_branches(10, [3, 5, 2], "mixed")


def test_mixed_reads_apart_branches_at_the_branch_point_and_replies_end_to_end(llama_engine):
    """MIXED is the branch point for branches encoded apart right after the prefix (the refresh leaves them as
    encoded) and the sequential layout for decoded replies (refreshed as there): token for token."""
    eng = llama_engine
    refresh = Refresh(1, 1)

    def answer(branches, prefix, placement, refresh=None):
        out = synthesize(eng, branches, "Synthesizer:", prefix=prefix, placement=placement, sampling=GREEDY,
                         refresh=refresh)
        return eng.message(out).token_ids, eng.message(out).offset

    prefix, replies = workflow(eng, ["Context A.", "A much longer context for worker B."])
    assert answer(replies, prefix, "mixed", refresh) == answer(replies, prefix, "sequential", refresh)
    apart = eng.prefill([PrefillCall(q, parents=prefix) for q in ["Question one: 3?", "Question two, longer: 4?"]])
    assert answer(apart, prefix, "mixed", refresh) == answer(apart, prefix, "branch_point")
    assert answer(apart, prefix, "mixed") != answer(apart, prefix, "sequential")


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

    def mapper(kv, *, branch, num_branches, length=None):
        seen[branch] = (kv.clone(), num_branches)
        return kv

    out = synthesize(eng, branches, "Synthesizer:", prefix=prefix, sampling=GREEDY,
                     hooks=SynthesisHooks(mapper=mapper))
    for j, b in enumerate(branches):
        msg = eng.message(b)
        delta = torch.full((msg.num_tokens,), n - msg.offset, dtype=torch.long, device=msg.kv.read().device)
        placed, m = seen[j]
        assert m == 2
        assert (placed[:, 0] - rerotate_keys_torch(msg.kv.read()[:, 0], delta, eng.lm.inv_freq)).abs().max() < 1e-6
        assert torch.equal(placed[:, 1], msg.kv.read()[:, 1])
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
    kv_a, kv_b = eng.message(at_branch_point).kv.read(), eng.message(sequential).kv.read()
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

    def silence_values(kv, *, branch, num_branches, length=None):
        out = kv.clone()
        out[:, 1] = 0
        return out

    eng.add_adapter("counted", adapter)
    stream = synthesize_stream(eng, branches, "Synthesizer:", prefix=prefix, sampling=GREEDY,
                               hooks=SynthesisHooks(mapper=silence_values, adapter="counted"))
    events = list(stream)
    # its message is marked as encoded by the adapted weights: no base-weight call takes it as a parent
    assert eng.message(stream.ids[0]).fingerprint == f"{eng.fingerprint}+counted"
    with pytest.raises(BraidError, match="encoded by model"):
        eng.decode([DecodeCall("Q:", parents=[stream.ids[0]], sampling=GREEDY)])
    with pytest.raises(BraidError, match="not loaded"):
        eng.decode([DecodeCall("Q:", parents=prefix, sampling=GREEDY, adapter="missing")])
    with pytest.raises(BraidError, match="same weights"):  # (a decode step's graph runs one set over every row)
        eng.decode([DecodeCall("Q:", parents=prefix, sampling=GREEDY, adapter="counted"),
                    DecodeCall("R:", parents=prefix, sampling=GREEDY)])
    with pytest.raises(BraidError, match="same weights"):
        eng.decode_stream([PrefillCall("a", parents=prefix, store=False, adapter="counted"),
                           DecodeCall("Q:", parents=prefix, sampling=GREEDY)])
    # the scheduler enters the adapter around each of the call's forwards: the header's, then one per token
    assert entered == ["in", "out"] * (1 + GREEDY.max_tokens) and len(events) == GREEDY.max_tokens
    plain = synthesize(eng, branches, "Synthesizer:", prefix=prefix, sampling=GREEDY)
    # the mapper's output is what the synthesizer attended to
    assert (eng.message(stream.ids[0]).kv.read() - eng.message(plain).kv.read()).abs().max() > 1e-4
    for b in branches:  # and the stored branches were not touched
        assert eng.message(b).kv.read()[:, 1].abs().max() > 0


def test_refresh_runs():
    assert Refresh(1, 1).runs(5) == [(0, 1), (4, 5)]
    assert Refresh(1, 1).runs(2) == [(0, 2)] and Refresh(1, 1).runs(1) == [(0, 1)]  # runs that meet merge
    assert Refresh(0, 2).runs(5) == [(3, 5)] and Refresh(3, 0).runs(5) == [(0, 3)] and Refresh(0, 0).runs(5) == []
    assert Refresh(8, 0).runs(5) == [(0, 5)]
    with pytest.raises(BraidError, match="non-negative"):
        Refresh(-1, 0)


def _answer(eng, mid):
    return eng.message(mid).token_ids[-GREEDY.max_tokens:]


def test_refresh_of_exact_branches_changes_nothing(family_engine):
    """Branches encoded one after another are already what text gives: refreshing their boundaries re-encodes
    the same tokens in the same context, so the answer is text's and the refreshed KV is the shipped KV."""
    eng = family_engine
    prefix = eng.prefill([PrefillCall("User: add the partial results.")])
    chain = []
    for text in ["Worker one: 3 + 4 = 7", "Worker two: 5 and 6", "Worker three: 1 2 3"]:
        chain += eng.prefill([PrefillCall(text, parents=[*prefix, *chain])])
    seen = []

    def mapper(kv, *, branch, num_branches, length=None):
        seen.append((branch, kv.shape[3], length))
        return kv

    own = lambda: [m for m in eng.store.ids() if not m.startswith(CACHED_PREFIX)]  # noqa: E731 (not the cache's)
    before = len(own())
    out = synthesize(eng, chain, "Synthesizer:", prefix=prefix, placement=Placement.SEQUENTIAL, sampling=GREEDY,
                     hooks=SynthesisHooks(mapper=mapper), refresh=Refresh(1, 2))
    text = synthesize_text(eng, chain, "Synthesizer:", prefix=prefix, sampling=GREEDY)
    assert _answer(eng, out) == _answer(eng, text)
    lengths = [eng.message(b).num_tokens for b in chain]
    # the mapper saw each branch's middle only, as a part of the whole branch; never the refreshed runs
    assert seen == [(j, n - 3, n) for j, n in enumerate(lengths)]
    assert len(own()) == before + 2  # the views and refreshed runs are gone; the two answers stay
    # the refreshed runs' KV is the shipped KV (same tokens, same context): read it back through a refresh
    # of everything, whose answer KV matches the plain cache path's
    whole = synthesize(eng, chain, "Synthesizer:", prefix=prefix, placement=Placement.SEQUENTIAL, sampling=GREEDY,
                       refresh=Refresh(100, 0))
    plain = synthesize(eng, chain, "Synthesizer:", prefix=prefix, placement=Placement.SEQUENTIAL, sampling=GREEDY)
    assert (eng.message(whole).kv.read() - eng.message(plain).kv.read()).abs().max() < 1e-4


def test_refresh_of_whole_branches_reads_them_together(checkpoint):
    """Two branches encoded independently after the prefix: the second never saw the first, so the plain cache
    path differs from text; refreshing all of it (it is then encoded after the prefix and the first branch)
    gives text's KV and answer. Refreshing nothing is the plain cache path exactly. (Weights drawn wider than
    the default, so that attention, and with it the context, visibly matters.)"""
    from braid.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(checkpoint("llama", initializer_range=0.3)))
    prefix = eng.prefill([PrefillCall("User: add the partial results.")])
    branches = eng.prefill([PrefillCall(t, parents=prefix) for t in ["Worker one: 3 + 4 = 7", "Worker two: 5 6"]])
    text = synthesize_text(eng, branches, "Synthesizer:", prefix=prefix, sampling=GREEDY)
    cached = synthesize(eng, branches, "Synthesizer:", prefix=prefix, placement="sequential", sampling=GREEDY)
    whole = synthesize(eng, branches, "Synthesizer:", prefix=prefix, placement="sequential", sampling=GREEDY,
                       refresh=Refresh(100, 0))
    none = synthesize(eng, branches, "Synthesizer:", prefix=prefix, placement="sequential", sampling=GREEDY,
                      refresh=Refresh(0, 0))
    prompt = len(eng.tokenize("Synthesizer:")) + GREEDY.max_tokens
    text_kv = eng.message(text).kv.read(eng.message(text).num_tokens - prompt)
    assert (eng.message(cached).kv.read() - text_kv).abs().max() > 1e-4
    assert (eng.message(whole).kv.read() - text_kv).abs().max() < 1e-4
    assert _answer(eng, whole) == _answer(eng, text)
    assert torch.equal(eng.message(none).kv.read(), eng.message(cached).kv.read())


def test_branches_longer_than_verified_are_read_from_their_text(checkpoint):
    """The gate's per-branch decision (Refresh.whole_over): a branch longer than the limit is re-encoded whole in
    the synthesizer's context, as text re-prefill reads it, and never goes through the mapper; the shorter ones
    are read from their KV. Two branches encoded apart after the prefix, the first short (at sequential placement
    its KV is text's already), the second long: reading the long one from its text gives text's KV and answer;
    a limit above both is the plain cache path exactly. (Weights drawn wide, so that the context matters.)"""
    from braid.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(checkpoint("llama", initializer_range=0.3)))
    prefix = eng.prefill([PrefillCall("User: add the partial results.")])
    branches = eng.prefill([PrefillCall(t, parents=prefix) for t in ["Worker: 5 6", "Worker two: 3 + 4 = 7 so 8"]])
    short, long = (eng.message(b).num_tokens for b in branches)
    assert short < long
    mapped = []

    def mapper(kv, *, branch, num_branches, length=None):
        mapped.append(branch)
        return kv

    def read(limit, hooks=None):
        mode = SynthesisMode(Placement.SEQUENTIAL, hooks, Refresh(0, 0, whole_over=limit))
        out = synthesis_stream(eng, branches, "Synthesizer:", prefix, mode, GREEDY)
        list(out)
        return out.ids[0], read_from_text(eng, branches, prefix, mode)

    text = synthesize_text(eng, branches, "Synthesizer:", prefix=prefix, sampling=GREEDY)
    cached = synthesize(eng, branches, "Synthesizer:", prefix=prefix, placement="sequential", sampling=GREEDY)
    prompt = len(eng.tokenize("Synthesizer:")) + GREEDY.max_tokens
    text_kv = eng.message(text).kv.read(eng.message(text).num_tokens - prompt)
    assert (eng.message(cached).kv.read() - text_kv).abs().max() > 1e-4  # the long branch never saw the short one
    gated, which = read(short, SynthesisHooks(mapper=mapper))
    assert which == [1] and mapped == [0]  # the long branch from its text, not through the mapper
    gated, which = read(short)
    assert (eng.message(gated).kv.read() - text_kv).abs().max() < 1e-4 and _answer(eng, gated) == _answer(eng, text)
    within, which = read(long)
    assert which == [] and torch.equal(eng.message(within).kv.read(), eng.message(cached).kv.read())
    assert read_from_text(eng, branches, prefix, SynthesisMode()) == [0, 1]  # text mode reads every branch so
    with pytest.raises(BraidError, match="whole_over"):
        Refresh(1, 1, whole_over=-1)


def test_a_sequential_refresh_reads_the_runs_before_it_re_encoded(checkpoint):
    """Three branches encoded independently. Refreshed whole in parallel, the third is encoded after the first
    two as shipped (the second never saw the first), so it is not text. Refreshed whole in order, each reads the
    ones before it re-encoded: text's KV and answer. A partial sequential refresh leaves nothing behind. (Four
    layers: a run's error from a context encoded apart starts in its third layer's KV, so the answer's KV shows
    it from the fourth on; in fewer, the parallel refresh is exact too.)"""
    from braid.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(checkpoint("llama", initializer_range=0.3, num_hidden_layers=4)))
    prefix = eng.prefill([PrefillCall("User: add the partial results.")])
    branches = eng.prefill([PrefillCall(t, parents=prefix)
                            for t in ["Worker one: 3 + 4 = 7", "Worker two: 5 6", "Worker three: 8 9 1"]])
    own = lambda: sorted(m for m in eng.store.ids() if not m.startswith(CACHED_PREFIX))  # noqa: E731
    before = own()
    text = synthesize_text(eng, branches, "Synthesizer:", prefix=prefix, sampling=GREEDY)
    parallel, sequential, partial = (
        synthesize(eng, branches, "Synthesizer:", prefix=prefix, placement="sequential", sampling=GREEDY,
                   refresh=r) for r in (Refresh(100, 0), Refresh(100, 0, sequential=True), Refresh(1, 2, True)))
    prompt = len(eng.tokenize("Synthesizer:")) + GREEDY.max_tokens
    text_kv = eng.message(text).kv.read(eng.message(text).num_tokens - prompt)
    assert (eng.message(parallel).kv.read() - text_kv).abs().max() > 1e-4
    assert (eng.message(sequential).kv.read() - text_kv).abs().max() < 1e-4
    assert _answer(eng, sequential) == _answer(eng, text)
    assert own() == sorted([*before, text, parallel, sequential, partial])  # the runs and views are gone


def test_refresh_failure_leaves_the_store_as_it_was(llama_engine):
    eng = llama_engine
    prefix, branches = workflow(eng, ["Context A.", "Context B, longer."])
    own = lambda: sorted(m for m in eng.store.ids() if not m.startswith(CACHED_PREFIX))  # noqa: E731
    before = own()
    with pytest.raises(BraidError, match="empty"):
        synthesis_stream(eng, branches, [], prefix=prefix,
                         mode=SynthesisMode(Placement.SEQUENTIAL, refresh=Refresh(1, 1)))
    assert own() == before  # (what the prefix cache keeps of the refreshed runs may stay: it is evictable)


def test_refresh_runs_beyond_one_prefills_worth_of_calls_go_in_turn(checkpoint):
    """More runs than one prefill takes at once (max_parallel_calls) are re-encoded a prefill's worth at a
    time: the same parts and KV as in one prefill."""
    from braid.engine import Engine, EngineConfig
    from braid.methods.synthesis import Runs, refresh_branches

    parts = {}
    for limit in (64, 2):
        eng = Engine(EngineConfig(checkpoint("llama"), max_parallel_calls=limit))
        prefix, (branch, *_) = workflow(eng, ["Part 3 and some more words here."])
        msg = eng.message(branch)
        got, made = refresh_branches(eng, prefix, [msg], [msg.offset], Runs.of([0, 2, 4, 6, 8]))
        parts[limit] = [(eng.message(p).token_ids, off, j, eng.message(p).kv.read()) for p, off, j in got]
        for mid in made:
            eng.free(mid)
    assert len(parts[2]) > 5 and [p[:3] for p in parts[2]] == [p[:3] for p in parts[64]]
    for a, b in zip(parts[2], parts[64]):
        torch.testing.assert_close(a[3], b[3], rtol=0, atol=1e-6)


def test_unstored_prefill_calls_are_checked_and_store_nothing(llama_engine):
    """A decode call may read only its own request's prefill calls (Sibling), where they are encoded; a prefill
    call with store=False stores nothing, and a prefill call after a decode call, or alone, is refused."""
    from braid.engine.engine import Sibling

    eng = llama_engine
    ctx, = eng.prefill([PrefillCall("Some context.")])
    n = eng.message(ctx).num_tokens
    lead = [PrefillCall("a b", parents=[ctx], new_offset=n, store=False)]
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    with pytest.raises(BraidError, match="offset"):
        eng.decode_stream([*lead, DecodeCall("Q:", parents=[ctx, Sibling(0)], offsets=[0, n + 1], sampling=greedy)])
    with pytest.raises(BraidError, match="prefill call of this request"):
        eng.decode_stream([*lead, DecodeCall("Q:", parents=[ctx, Sibling(1)], sampling=greedy)])
    with pytest.raises(BraidError, match="come before"):
        eng.decode_stream([DecodeCall("Q:", parents=[ctx], sampling=greedy), *lead])
    with pytest.raises(BraidError, match="not stored"):
        eng.prefill(lead)
    with pytest.raises(BraidError, match="store=False"):
        eng.decode_stream([replace(lead[0], store=True), DecodeCall("Q:", parents=[ctx, Sibling(0)], sampling=greedy)])
    before = set(eng.store.ids())
    stream = eng.decode_stream([*lead, DecodeCall("Q:", parents=[ctx, Sibling(0)], sampling=greedy)])
    events = list(stream)
    assert {e.call for e in events} == {0} and len(events) == 3
    assert set(eng.store.ids()) - before == {stream.ids[0]}
    msg = eng.message(stream.ids[0])
    assert msg.parents == (ctx,) and msg.offset == n + len(eng.tokenize("a b"))
    # the same as reading the prefill call's message, prefilled first
    part, = eng.prefill([replace(c, store=True) for c in lead])
    again = eng.decode([DecodeCall("Q:", parents=[ctx, part], sampling=greedy)])
    assert eng.message(again[0]).token_ids == msg.token_ids
    torch.testing.assert_close(eng.message(again[0]).kv.read(), msg.kv.read(), rtol=0, atol=1e-5)
