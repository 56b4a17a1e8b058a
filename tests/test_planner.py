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
