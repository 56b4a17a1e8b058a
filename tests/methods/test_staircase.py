"""Staircase streaming on one engine: the chunk schedule, exactness against wait-for-all, the append layout in
text and KV, redundancy, and a branch that fails mid-stream."""

import threading
import time

import pytest

from braid.engine import PrefillCall, SamplingParams
from braid.engine.errors import BraidError
from braid.methods.fanout import fan_out
from braid.methods.staircase import BranchFeed, RoundTaken, StaircaseResult, StaircaseSchedule, Variant, staircase
from braid.methods.synthesis import TEXT, Placement, Refresh, SynthesisMode, synthesis_stream

TASK, CONTEXTS, PROMPT = "User: add the parts.", ["Part 3.", "Part 4 and 5.", "Part 6, 7."], "Synthesizer:"
WORKER = SamplingParams(max_tokens=12, ignore_eos=True)
ANSWER = SamplingParams(max_tokens=10, ignore_eos=True)
WHOLE = (10_000,)  # a first chunk no branch reaches: the aggregator takes each branch once it has ended
KV = SynthesisMode(Placement.SEQUENTIAL)


def run(engine, schedule, variant, mode, fan_outs=None, prefix=None):
    fan_outs = fan_outs or [fan_out(engine, TASK, CONTEXTS, "W:", WORKER)]
    prefix = prefix if prefix is not None else engine.prefill([PrefillCall(TASK)])
    feed = BranchFeed(fan_outs)
    result = StaircaseResult()
    events = list(staircase(engine, feed, PROMPT, prefix, schedule, variant, mode, ANSWER, idle_s=60,
                            result=result))
    feed.join()
    return result, events, fan_outs, prefix


def test_schedule_boundaries_quorum_and_validation():
    s = StaircaseSchedule((8, 128, 256), (8, 128), redundancy=2)
    assert [s.boundary(n) for n in (0, 7, 8, 135, 136, 391, 392, 647, 648)] == [0, 0, 8, 8, 136, 136, 392, 392, 648]
    assert [s.aggregator_chunk(k) for k in range(4)] == [8, 128, 128, 128]
    assert s.quorum(5) == 3
    with pytest.raises(BraidError, match="redundancy 2 leaves no branch"):
        s.quorum(2)
    for bad in [dict(proposer=()), dict(proposer=(8, 0)), dict(aggregator=(-1,)), dict(redundancy=-1)]:
        with pytest.raises(BraidError):
            StaircaseSchedule(**bad)


@pytest.mark.parametrize("variant, mode", [
    (Variant.REPREFILL, TEXT), (Variant.REPREFILL, SynthesisMode(Placement.BRANCH_POINT)),
    (Variant.REPREFILL, SynthesisMode(Placement.SEQUENTIAL, refresh=Refresh(1, 1))),
    (Variant.APPEND, TEXT), (Variant.APPEND, KV), (Variant.APPEND, SynthesisMode(Placement.SEQUENTIAL,
                                                                                 refresh=Refresh(1, 1)))],
    ids=["reprefill-text", "reprefill-kv", "reprefill-kv-refresh", "append-text", "append-kv", "append-kv-refresh"])
def test_whole_branches_answer_as_wait_for_all(fresh_engine, variant, mode):
    """Branches taken whole, the answer decoded in rounds of 3 and 5 tokens with the prompt and the answer so
    far re-encoded each round: the same greedy tokens as one synthesis after every branch has ended. (Append
    places the branches one after another, as the sequential placement does; its refresh re-encodes each
    chunk's boundary tokens, here each whole branch's, as the synthesis's does.)"""
    result, events, (branches,), prefix = run(fresh_engine, StaircaseSchedule(WHOLE, (3, 5)), variant, mode)
    lengths = [fresh_engine.message(b).num_tokens for b in branches.ids]  # header + 12 tokens
    assert result.rounds[0].chunks == {j: (0, n) for j, n in enumerate(lengths)}
    assert all(not r.chunks for r in result.rounds[1:]) and len(result.rounds) == 3
    expected = [e.token_id for e in synthesis_stream(fresh_engine, branches.ids, PROMPT, prefix, mode, ANSWER)]
    assert result.answer == expected and len(expected) == 10


def test_append_puts_text_and_kv_chunks_at_the_same_positions(fresh_engine):
    """Append, text and KV: the chunks sit right after the chunks so far, in branch order, then the prompt and the
    answer so far. Same tokens, same positions; only where the chunk KV came from differs (the workers' encoding
    in KV mode, a prefill after the chunks before in text mode)."""
    ends, answers = {}, {}
    for name, mode in (("text", TEXT), ("kv", KV)):
        result, _, (branches,), prefix = run(fresh_engine, StaircaseSchedule(WHOLE, (4, 3)), Variant.APPEND, mode)
        last = fresh_engine.message(result.message_ids[-1])
        ends[name] = last.end
        answers[name] = result.answer
        chunk_tokens = sum(fresh_engine.message(b).num_tokens for b in branches.ids)
        prompt_tokens = len(fresh_engine.tokenize(PROMPT))
        # prefix, the three branches, then the last round's message: the prompt and the 10 answer tokens
        assert last.end == fresh_engine.message(prefix[0]).end + chunk_tokens + prompt_tokens + 10
        assert last.token_ids == tuple(fresh_engine.tokenize(PROMPT) + result.answer)
    assert ends["text"] == ends["kv"] and len(answers["text"]) == len(answers["kv"]) == 10


class Released:
    """A decoded branch message handed to a staircase `step` tokens at a time (a BranchFeed source, read as
    BranchArrivals is): each release once the staircase has taken in the one before, so every run sees the same
    rounds."""

    def __init__(self, engine, message_id: str, step: int):
        self.msg, self.step, self.n, self.error = engine.message(message_id), step, 0, None
        self.decode = self

    offsets = property(lambda self: [self.msg.offset])
    length = property(lambda self: self.msg.num_tokens if self.n == self.msg.num_tokens else None)

    def encoded(self, call: int = 0) -> int:
        return self.n

    def partial_kv(self, call: int, start: int, end: int):
        return list(self.msg.token_ids[start:end]), self.msg.kv.read(start, end)

    def release(self, feed: BranchFeed, result: StaircaseResult) -> None:
        while self.n < self.msg.num_tokens:
            self.n = min(self.n + self.step, self.msg.num_tokens)
            feed.arrived(self)
            taken = len([r for r in result.rounds if r.chunks])
            while len([r for r in result.rounds if r.chunks]) == taken and not feed.cancelled:
                time.sleep(0.002)


@pytest.mark.parametrize("refresh", [None, Refresh(1, 1)], ids=["kv", "kv-refresh"])
def test_kv_append_gives_text_appends_greedy_tokens(fresh_engine, refresh):
    """One branch, read after the prefix and its own context (where its worker encoded it), 4 tokens a round:
    each KV chunk sits where text append encodes it, seeing what it sees there, so KV append (and its boundary
    refresh, which re-encodes tokens to the same KV) gives text append's greedy tokens, round for round."""
    fan = fan_out(fresh_engine, TASK, CONTEXTS[:1], "W:", SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in fan:
        pass
    context = [*fan.prefix, *fan.contexts]
    answers, rounds = {}, {}
    for name, mode in (("text", TEXT), ("kv", SynthesisMode(Placement.SEQUENTIAL, refresh=refresh))):
        source, result = Released(fresh_engine, fan.ids[0], 4), StaircaseResult()
        feed = BranchFeed([], pump=False, branches=[(source, 0)])
        releases = threading.Thread(target=source.release, args=(feed, result), daemon=True)
        releases.start()
        list(staircase(fresh_engine, feed, PROMPT, context, StaircaseSchedule((4,), (2,)), Variant.APPEND, mode,
                       SamplingParams(max_tokens=16, ignore_eos=True), idle_s=60, result=result))
        releases.join()
        answers[name], rounds[name] = result.answer, [r.chunks for r in result.rounds]
        fresh_engine.free(result.message_ids[-1])
    assert rounds["kv"] == rounds["text"] and sum(1 for chunks in rounds["kv"] if chunks) > 3
    assert answers["kv"] == answers["text"] and len(answers["text"]) == 16
    fan.free()


@pytest.mark.parametrize("variant", list(Variant))
def test_redundancy_starts_without_the_slowest_branch(fresh_engine, variant):
    """Two worker calls; the second starts late. With redundancy 1 the first round takes only the first call's
    first chunk; the late branch is taken in by a later round."""
    fast = fan_out(fresh_engine, TASK, CONTEXTS[:1], "W:", WORKER)
    slow = fan_out(fresh_engine, TASK, CONTEXTS[1:2], "W:", WORKER, on_start=lambda _: time.sleep(1.0))
    result, *_ = run(fresh_engine, StaircaseSchedule((4, 4), (2, 3), redundancy=1), variant, KV, [fast, slow])
    assert set(result.rounds[0].chunks) == {0}
    assert any(1 in r.chunks for r in result.rounds[1:]) and len(result.answer) == 10 and not result.failed


def test_a_failed_worker_call_leaves_the_answer_to_the_others(fresh_engine):
    """One worker call stops mid-stream (its client went away): the aggregator finishes with the other call's
    branches and reports the lost ones. (The lost call starts once the kept one has ended, so the first round
    takes the kept branches whole however the threads are scheduled: the answer can end before a branch does.)"""
    keep = fan_out(fresh_engine, TASK, CONTEXTS[:2], "W:", WORKER)
    lost = fan_out(fresh_engine, TASK, CONTEXTS[2:], "W:", SamplingParams(max_tokens=400, ignore_eos=True))

    def stop_soon(stream):
        deadline = time.monotonic() + 60
        while keep.ids is None and time.monotonic() < deadline:
            time.sleep(0.01)

        def later():
            while stream.decode is None or stream.encoded(0) < 6:
                time.sleep(0.01)
            stream.decode.interrupt()  # what a client going away does to its call
        threading.Thread(target=later, daemon=True).start()

    lost.on_start = stop_soon
    result, *_ = run(fresh_engine, StaircaseSchedule((4, 4), (3, 4)), Variant.REPREFILL, KV, [keep, lost])
    assert set(result.failed) == {2} and "cancelled" in result.failed[2]
    for j in (0, 1):  # the kept branches were taken in whole
        taken = max(r.chunks[j][1] for r in result.rounds if j in r.chunks)
        assert taken == fresh_engine.message(keep.ids[j]).num_tokens
    assert len(result.answer) == 10


@pytest.mark.parametrize("refresh", [None, Refresh(1, 1)], ids=["kv", "kv-refresh"])
@pytest.mark.parametrize("leave_after", [2, 5, None], ids=["round0", "round1", "end"])
def test_append_keeps_nothing_but_its_answer(fresh_engine, refresh, leave_after):
    """Append over small chunks (with their boundaries refreshed, or not): closing the staircase mid-round stops
    its call and frees every chunk it imported and every refreshed run; what is left is the answer so far (the
    last round's message, which the caller owns)."""
    before = set(fresh_engine.store.ids())
    prefix = fresh_engine.prefill([PrefillCall(TASK)])
    fan = fan_out(fresh_engine, TASK, CONTEXTS, "W:", WORKER)
    feed, result = BranchFeed([fan]), StaircaseResult()
    run = staircase(fresh_engine, feed, PROMPT, prefix, StaircaseSchedule((4, 4), (3, 5)), Variant.APPEND,
                    SynthesisMode(Placement.SEQUENTIAL, refresh=refresh), ANSWER, result=result)
    tokens = 0
    for event in run:
        tokens += hasattr(event, "token_id")
        if tokens == leave_after:
            break
    run.close()
    feed.join()
    fan.free()
    fresh_engine.free(prefix[0])
    if leave_after is None:
        assert len(result.answer) == 10 and len(result.rounds) > 2
    for mid in result.message_ids[-1:]:  # the answer so far is the caller's
        fresh_engine.free(mid)
    left = {m for m in set(fresh_engine.store.ids()) - before if not m.startswith("~")}  # (the prefix cache)
    assert not left, left


def test_append_maps_each_chunk_with_its_branch_length_so_far(fresh_engine):
    """The mapper was trained with whole-branch lengths: each round it sees every chunk with its branch's
    length so far, never the chunk's own length."""
    from braid.methods.synthesis import SynthesisHooks

    seen = []

    def mapper(kv, *, branch, num_branches, length=None):
        seen.append((branch, kv.shape[3], length))
        return kv

    mode = SynthesisMode(Placement.SEQUENTIAL, SynthesisHooks(mapper=mapper))
    result, _, (branches,), _ = run(fresh_engine, StaircaseSchedule((4, 4), (3,)), Variant.APPEND, mode)
    lengths = [fresh_engine.message(b).num_tokens for b in branches.ids]
    assert seen and all(length is not None and length >= chunk for _, chunk, length in seen)
    assert any(length > chunk for _, chunk, length in seen)  # later rounds: earlier chunks, longer branches
    assert max(length for _, _, length in seen) == max(lengths)


def test_only_the_answers_last_token_says_it_finished(fresh_engine):
    """Rounds end on their token budget, but only the answer's last event carries a finish reason and its
    message id; imported chunks are held from eviction while the run goes, and released after it."""
    result, events, (branches,), _ = run(fresh_engine, StaircaseSchedule((4, 4), (3,)), Variant.APPEND, KV)
    tokens = [e for e in events if not isinstance(e, RoundTaken)]
    assert len(result.rounds) > 1 and len(tokens) == 10
    assert [e.finish_reason for e in tokens] == [None] * 9 + ["length"]
    assert [e.message_id for e in tokens[:-1]] == [None] * 9 and tokens[-1].message_id == result.message_ids[-1]
    assert set(+fresh_engine.store._held) <= set(branches._held)  # (what is still held is the fan-out's own)
