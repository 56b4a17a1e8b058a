"""engine.planner: a request's calls checked and placed in the caller's thread; engine.committer: the scheduler's way
back to the engine's store."""

import pytest

from braid.engine import DecodeCall, PrefillCall, SamplingParams, Sibling
from braid.engine.committer import PlannedKV
from braid.engine.errors import InvalidOffsetError


def test_a_plan_places_each_parent_once_and_masks_calls_apart(llama_engine):
    """Two decode calls that read one parent at one offset share its entry; a third reading it elsewhere gets its
    own; each call sees its parents and itself, never a sibling decode call; a lead prefill call read as
    Sibling(0) comes first and is seen by the call that names it."""
    eng = llama_engine
    a, = eng.prefill([PrefillCall("a shared parent")])
    n = eng.message(a).num_tokens
    try:
        calls = [PrefillCall("lead", store=False), DecodeCall("x", [a]), DecodeCall("y", [a, Sibling(0)]),
                 DecodeCall("z", [a], offsets=[n + 3])]
        plan = eng.planner.plan(calls, eng.planner.check(calls))
        assert [(m.id, off) for m, off in plan.entries] == [(a, 0), (a, n + 3)]
        lead = len(eng.tokenize("lead"))  # (a Sibling is read where it was encoded: y's own tokens follow it)
        assert plan.lead == 1 and [c.offset for c in plan.calls] == [0, n, lead, 2 * n + 3]
        entries = len(plan.entries)
        assert plan.visible[:, :entries].tolist() == [[False, False], [True, False], [True, False], [False, True]]
        assert plan.visible[:, entries:].tolist() == [[True, False, False, False], [False, True, False, False],
                                                     [True, False, True, False], [False, False, False, True]]
        assert plan.calls[3].parent_offsets == (n + 3,) and plan.parent_ids == {a}
        with pytest.raises(InvalidOffsetError, match="2 offsets given for 1 parents"):
            eng.planner.plan([DecodeCall("x", [a], offsets=[0, 1])], 0)
    finally:
        eng.free(a)


def test_the_scheduler_reaches_the_store_through_the_request_s_planned_kv(llama_engine):
    """What the scheduler holds of a request's KV is its PlannedKV (engine.scheduler.RequestKV), over the engine's
    committer: the request's message is committed through it, and its parent's pin released at the end."""
    eng = llama_engine
    a, = eng.prefill([PrefillCall("a parent")])
    try:
        stream = eng.decode_stream([DecodeCall("go", [a], sampling=SamplingParams(max_tokens=3, ignore_eos=True))])
        kv = stream._request.kv
        assert isinstance(kv, PlannedKV) and kv.committer is eng.committer and eng.store.pinned_count(a) == 1
        events = list(stream)
        assert len(events) == 3 and stream.ids and eng.message(stream.ids[0]).parents == (a,)
        assert eng.store.pinned_count(a) == 0
        eng.free(stream.ids[0])
    finally:
        eng.free(a)


def test_the_prefix_cache_amends_the_plan_it_was_given(checkpoint):
    """Planned once: a call found whole in the prefix cache leaves the plan as a ready message; a call whose
    start is cached keeps its place, encodes only the rest after it, and reads that start as a lent parent at
    the offset its message begins; a miss is left as planned."""
    from braid.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(checkpoint("llama"), prefix_block_tokens=4))
    start = list(range(3, 15))  # 12 tokens: three whole blocks
    cached, = eng.prefill([PrefillCall(start)])
    calls = [PrefillCall(start), PrefillCall([*start, 20, 21, 22]), PrefillCall([30, 31, 32])]
    with eng._store_lock:
        plan = eng.planner.plan(calls, eng.planner.check(calls))
        ids = [c.message_id for c in plan.calls]
        rest, ready, views = eng.planner.reuse(plan)
    try:
        assert list(ready) == [0] and eng.message(ready[0]).token_ids == tuple(start)
        assert [c.message_id for c in rest.calls] == ids[1:]  # (the same calls, amended: not planned again)
        grown, miss = rest.calls
        assert (grown.tokens, grown.offset, grown.reused) == ([20, 21, 22], 12, 12)
        assert (miss.tokens, miss.offset, miss.prefix) == ([30, 31, 32], 0, None)
        assert [(m.id, off) for m, off in rest.entries] == [(grown.prefix.id, 0)] and views == [grown.prefix.id]
        assert rest.visible.tolist() == [[True, True, False], [False, False, True]]
    finally:
        eng.discard([*views, *ready.values(), cached], when_unpinned=False)
