"""The scheduler: calls from many threads batched into shared forwards, each exactly as it runs alone."""

import threading
import time

import pytest
import torch

from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.engine.errors import BraidError, StoreFullError
from braid.engine.threads import serving_thread

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
REQUESTS = [  # (task, branch contexts): different lengths, different branch counts
    ("User: add the partial results.", ["Part 3.", "Part 4 and 5."]),
    ("System: a much longer shared task, with many more words in it than the others have.", ["One."]),
    ("User: tell me.", ["A context.", "Another, longer context here.", "Third."]),
    ("User: short.", ["x y z", "a b"]),
]


def workflow(eng: Engine, task: str, contexts: list[str], sampling: SamplingParams = GREEDY) -> list[list[int]]:
    """Prefill a task, the branch contexts after it, decode every branch: each branch's generated tokens."""
    prefix = eng.prefill([PrefillCall(task)])
    ctx = eng.prefill([PrefillCall(c, parents=prefix) for c in contexts])
    ids = eng.decode([DecodeCall("Assistant:", parents=[*prefix, c], sampling=sampling) for c in ctx])
    header = len(eng.tokenize("Assistant:"))
    return [list(eng.message(m).token_ids[header:]) for m in ids]


def concurrently(fn, args_list):
    results, errors = [None] * len(args_list), []

    def run(i, args):
        try:
            results[i] = fn(*args)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("home,attention", [("dense", "sdpa"), ("paged", "sdpa"), ("paged", "flex")])
def test_batched_with_others_equals_alone(checkpoint, home, attention):
    """fp32 greedy: each request's tokens are the same run alone or batched with requests of other lengths
    (and from other threads, as other sessions would be); and the batches did hold several requests. With either
    KV home (paged: the parents read where they are stored, in blocks other requests' calls write beside), and
    with attention read in place (flex: each group through its page table)."""
    eng = Engine(EngineConfig(checkpoint("llama"), kv_home=home, attention=attention))
    alone = [workflow(eng, task, contexts) for task, contexts in REQUESTS]
    steps_alone = eng.scheduler.steps
    eng.scheduler.requests_stepped = eng.scheduler.steps = 0
    together = concurrently(lambda t, c: workflow(eng, t, c), REQUESTS * 2)
    assert together == alone * 2
    assert eng.scheduler.requests_stepped / eng.scheduler.steps > 1.5  # mean calls per forward
    assert eng.scheduler.steps < 2 * steps_alone
    assert eng.scheduler.load == {"waiting": 0, "running": 0, "reserved_bytes": 0}


def test_chunked_prefill_and_waiting_for_kv_budget_change_nothing(checkpoint, llama_engine):
    """Prefills split into 3-row chunks, and a KV budget that holds one call at a time: same tokens, and
    the KV of a chunked prefill matches the one-forward prefill."""
    path = checkpoint("llama")
    want = [workflow(llama_engine, task, contexts) for task, contexts in REQUESTS]
    per_token = llama_engine.spec.num_layers * 2 * llama_engine.spec.num_kv_heads * llama_engine.spec.head_dim * 4
    small = Engine(EngineConfig(path, max_batched_tokens=3, kv_budget_bytes=120 * per_token))
    assert concurrently(lambda t, c: workflow(small, t, c), REQUESTS) == want
    task = REQUESTS[1][0]
    chunked, whole = small.prefill([PrefillCall(task)]), llama_engine.prefill([PrefillCall(task)])
    torch.testing.assert_close(small.message(chunked[0]).kv.read(), llama_engine.message(whole[0]).kv.read(), rtol=1e-5,
                               atol=1e-5)
    # a call bigger than the whole budget is refused at once, with what it needs; the engine goes on
    with pytest.raises(StoreFullError, match="kv_budget_bytes"):  # (when the call is made: before any event)
        small.decode_stream([DecodeCall("Assistant:", parents=chunked, sampling=SamplingParams(max_tokens=200))])
    small.free(chunked[0])  # (not left pinned by the refused call)
    assert workflow(small, *REQUESTS[0]) == want[0]


def test_serial_engine_runs_one_call_at_a_time(checkpoint, llama_engine):
    serial = Engine(EngineConfig(checkpoint("llama"), max_running_requests=1))
    want = [workflow(llama_engine, task, contexts) for task, contexts in REQUESTS]
    assert concurrently(lambda t, c: workflow(serial, t, c), REQUESTS) == want
    assert serial.scheduler.requests_stepped == serial.scheduler.steps


def test_forwards_run_on_the_configured_cpu_threads_and_give_the_same_tokens(checkpoint, monkeypatch):
    """EngineConfig.cpu_threads is the intra-op thread count of the scheduler's thread, where forwards run (0: the
    count of the thread that made the engine), which loads the model on one thread; the caller's own setting is
    left as it was, and threads that start torch work after an engine is made run it on one (engine.threads).
    Greedy tokens do not depend on it."""
    import braid.engine.engine as engine_module

    loading, load = [], engine_module.load_model
    monkeypatch.setattr(engine_module, "load_model", lambda *a: loading.append(torch.get_num_threads()) or load(*a))
    caller, tokens = torch.get_num_threads(), []
    for threads, want in ((1, 1), (3, 3), (0, caller)):
        eng = Engine(EngineConfig(checkpoint("llama"), cpu_threads=threads))
        assert loading.pop() == 1
        seen, step = [], eng.runner.step

        def spy(*args, step=step, seen=seen, **kw):
            seen.append(torch.get_num_threads())
            return step(*args, **kw)

        eng.runner.step = spy
        tokens.append(workflow(eng, *REQUESTS[0]))
        assert set(seen) == {want} and torch.get_num_threads() == caller
        later = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert later == [1]
    assert all(t == tokens[0] for t in tokens)
    serving = []  # (a deployment's thread that made an engine and serves requests: one thread there too)
    thread = threading.Thread(target=lambda: (torch.set_num_threads(caller), serving_thread("cpu"),
                                              serving.append(torch.get_num_threads())))
    thread.start()
    thread.join()
    assert serving == [1]
    with pytest.raises(ValueError, match="cpu_threads must be an int >= 0"):
        EngineConfig(checkpoint("llama"), cpu_threads=-1)


def test_a_cancelled_call_leaves_the_batch_and_stores_nothing(llama_engine):
    eng = llama_engine
    prefix = eng.prefill([PrefillCall("User: go on for a long time.")])
    before = set(eng.store.ids())
    stream = eng.decode_stream([DecodeCall("Assistant:", parents=prefix,
                                           sampling=SamplingParams(max_tokens=400, ignore_eos=True))])
    events = iter(stream)
    next(events), next(events)
    stream.close()  # returns once the call has ended: its parent is unpinned already
    eng.free(prefix[0])
    assert eng.scheduler.load == {"waiting": 0, "running": 0, "reserved_bytes": 0}
    assert set(eng.store.ids()) == before - {prefix[0]}  # nothing stored
    # the engine serves on
    assert len(workflow(eng, *REQUESTS[0])) == 2


def test_a_zeroed_pool_zeroes_a_block_when_it_first_hands_it_out(llama_engine):
    """KVPool(zeroed=True) (attention in place reads the slots it masks): a block is zero when first handed out,
    whatever its memory held; one handed back and out again keeps what was written to it; blocks never handed out
    are left untouched (no memory of a large pool's store part is written before it is used)."""
    from braid.engine.kv_cache import KVPool

    pool = KVPool(llama_engine.lm, 6, block_tokens=4, zeroed=True)
    pool.kv[:, :, :, :pool.trash] = float("nan")  # (what fresh memory may hold)
    a = pool.allocate(9)  # 3 fresh blocks
    assert a == [0, 1, 2] and not pool.kv[:, :, :, :12].any() and pool.kv[:, :, :, 12:pool.trash].isnan().all()
    pool.kv[:, :, :, 4:8] = 1.0  # (a call writes block 1)
    pool.release(a)
    b = pool.allocate(16)  # 3 handed back (as written) and 1 fresh (zeroed)
    assert sorted(b) == [0, 1, 2, 3] and (pool.kv[:, :, :, 4:8] == 1).all() and not pool.kv[:, :, :, 12:16].any()
    assert pool.kv[:, :, :, 16:pool.trash].isnan().all()


def test_pool_hands_out_whole_blocks_and_a_call_reads_its_own(llama_engine):
    from braid.engine.kv_cache import KVPool, WorkCache

    pool = KVPool(llama_engine.lm, 6, block_tokens=4)
    a, b = pool.allocate(9), pool.allocate(4)  # 9 tokens: 3 blocks
    assert (len(a), len(b), pool.free_blocks) == (3, 1, 2) and pool.allocate(9) is None
    pool.release(a)
    c = pool.allocate(20)  # any free blocks serve: no fragmentation
    assert len(c) == 5 and pool.free_blocks == 0
    cache = WorkCache(llama_engine.lm, 20, pool, c)
    kv = torch.randn(*pool.kv.shape[:3], 20, pool.kv.shape[4], device=pool.kv.device)
    cache.append(kv[:, 0], kv[:, 1], segment=0)
    assert torch.equal(cache.gather(torch.arange(20, device=kv.device)), kv)  # logical order, whatever the blocks
    assert torch.equal(cache.layer_kv(1, 0, 20), kv[1]) and torch.equal(cache.layer_kv(1, 5, 20), kv[1, :, :, 5:])


def test_a_dropped_engine_is_freed_and_its_scheduler_thread_ends(checkpoint):
    import gc
    import weakref

    eng = Engine(EngineConfig(checkpoint("llama")))
    workflow(eng, *REQUESTS[0])
    thread, ref = eng.scheduler._thread, weakref.ref(eng)
    del eng
    deadline = time.time() + 10
    while ref() is not None and time.time() < deadline:  # (its last step may still hold a finished call)
        gc.collect()
        time.sleep(0.05)
    thread.join(5)
    assert ref() is None and not thread.is_alive()


def test_a_cancelled_waiting_call_ends_and_unpins(checkpoint):
    """A call queued behind a full arena, then cancelled, ends at once: its parents can be freed."""
    path = checkpoint("llama")
    probe = Engine(EngineConfig(path))
    per_token = probe.spec.num_layers * 2 * probe.spec.num_kv_heads * probe.spec.head_dim * 4
    eng = Engine(EngineConfig(path, kv_budget_bytes=300 * per_token, kv_on_demand=False))  # (waits for all)
    a, b = eng.prefill([PrefillCall("User: first."), PrefillCall("User: second.")])
    long = SamplingParams(max_tokens=250, ignore_eos=True)
    running = eng.decode_stream([DecodeCall("Assistant:", parents=[a], sampling=long)])
    queued = eng.decode_stream([DecodeCall("Assistant:", parents=[b], sampling=long)])
    events = iter(running)
    next(events)
    assert eng.scheduler.load["waiting"] == 1
    queued.close()
    eng.free(b)  # unpinned: no MessageInUseError
    running.close()
    eng.free(a)
    assert eng.scheduler.load == {"waiting": 0, "running": 0, "reserved_bytes": 0}


def test_partial_kv_reads_the_stored_message_once_the_call_has_ended(llama_engine):
    eng = llama_engine
    p = eng.prefill([PrefillCall("User: tell me more.")])
    stream = eng.decode_stream([DecodeCall("Assistant:", parents=p, sampling=GREEDY)])
    events = list(stream)
    msg = eng.message(stream.ids[0])
    tokens, kv = stream.partial_kv(0, 2, msg.num_tokens)  # (the work cache may belong to another call now)
    assert tokens == list(msg.token_ids[2:]) and torch.equal(kv, msg.kv.read(2)) and len(events) == 10


def test_closing_a_stream_that_has_just_ended_keeps_its_messages_known(llama_engine):
    """A client that leaves as the last token arrives: the call had already stored its messages, and the
    stream still names them, so whoever owns it can free them."""
    eng = llama_engine
    p = eng.prefill([PrefillCall("User: short.")])
    stream = eng.decode_stream([DecodeCall("Assistant:", parents=p, sampling=SamplingParams(max_tokens=2))])
    deadline = time.time() + 30
    while stream._request.stored_ids is None and time.time() < deadline:  # ended, stored; nothing read yet
        time.sleep(0.01)
    stream.close()
    assert stream.ids == stream._request.stored_ids and stream.ids[0] in eng.store
    assert eng.scheduler.load["reserved_bytes"] == 0  # its blocks were back before the end was told
    eng.free(stream.ids[0])
    eng.free(p[0])


def test_parents_read_in_place_answer_as_copies_and_are_kept_once(checkpoint):
    """share_parents: a parent placed where it was encoded (a block long at least) is read in place from one run
    in the pool, however many running calls read it. Tokens are exactly those of calls that copy their parents (fp32), the run goes with
    its last reader, and a parent placed elsewhere is still copied (re-rotated)."""
    path = checkpoint("llama")
    # (calls reserve their max_tokens up front here, so what they hold is known)
    eng, copying = (Engine(EngineConfig(path, kv_on_demand=False, kv_home="dense")),  # (paged: read where they are)
                    Engine(EngineConfig(path, share_parents=False, kv_on_demand=False, kv_home="dense")))
    want = [workflow(copying, task, contexts) for task, contexts in REQUESTS]
    assert concurrently(lambda t, c: workflow(eng, t, c), REQUESTS * 2) == want * 2
    pool = eng.scheduler.pool
    assert not pool.shared and pool.free_blocks == pool.blocks - pool.held_blocks  # (held: the stored messages')
    # four calls at once read one 200-token parent: one run of it in the pool, four readers
    long = SamplingParams(max_tokens=1000, ignore_eos=True)  # (far longer than the checks below take)
    reserved = {}
    for e in (eng, copying):
        prefix = e.prefill([PrefillCall(" ".join(f"w{i % 40}" for i in range(200)))])
        streams = [e.decode_stream([DecodeCall(f"Agent {i}:", parents=prefix, sampling=long)]) for i in range(4)]
        events = [iter(s) for s in streams]
        for ev in events:
            next(ev)  # (all four admitted and decoding)
        load = e.scheduler.load
        assert load["running"] == 4
        reserved[e is eng] = load["reserved_bytes"]
        n, h = e.message(prefix[0]).num_tokens, len(e.tokenize("Agent 0:"))
        if e is eng:
            (run,) = pool.shared.values()
            assert run.refs == 4 and run.index.numel() == n
        for s in streams:
            s.close()
        e.free(prefix[0])
    blocks, block_bytes = pool.blocks_for, pool.block_tokens * eng.scheduler.slot_bytes
    assert reserved[False] == 4 * blocks(n + h + 1000) * block_bytes  # each call: its copy, header, max_tokens
    assert reserved[True] == (4 * blocks(h + 1000) + blocks(n)) * block_bytes  # the parent once
    assert not pool.shared and pool.free_blocks == pool.blocks - pool.held_blocks
    # a parent placed elsewhere is copied (nothing shared while it runs), and answers as the copying engine's does
    answers = {}
    for e in (eng, copying):
        p = e.prefill([PrefillCall("User: a parent placed further on.")])
        stream = e.decode_stream([DecodeCall("A:", parents=p, offsets=[7], sampling=GREEDY)])
        got = []
        for ev in stream:
            got.append(ev.token_id)
            if e is eng and len(got) == 1:
                assert not pool.shared and eng.scheduler.load["running"] == 1  # (running, its parent copied)
        answers[e is eng] = got
    assert answers[True] == answers[False]
    # a call whose parents are mostly copied anyway copies them all (its own blocks then read as one view)
    small = eng.prefill([PrefillCall(" ".join(f"s{i}" for i in range(12)))])
    big = eng.prefill([PrefillCall(" ".join(f"b{i % 30}" for i in range(150)))])
    n_small = eng.message(small[0]).num_tokens
    stream = eng.decode_stream([DecodeCall("A:", parents=[*small, *big], offsets=[0, n_small + 5], sampling=GREEDY)])
    for i, _ in enumerate(stream):
        if i == 0:
            assert eng.message(small[0]).num_tokens >= pool.block_tokens and not pool.shared


def test_a_run_that_cannot_be_copied_in_fails_its_call_alone(checkpoint, monkeypatch):
    """Copying a shared run into the pool can fail (a device out of memory): that call fails with the error and
    hands back what it took; the scheduler goes on serving. (A parent that lives in the pool, kv_home paged, is
    read where it is: nothing to copy in.)"""
    eng = Engine(EngineConfig(checkpoint("llama"), kv_home="dense"))
    prefix = eng.prefill([PrefillCall(" ".join(f"w{i % 40}" for i in range(60)))])
    pool, real, tries = eng.scheduler.pool, eng.scheduler.pool.share, []

    def share(kv, offset):  # (the first copy-in fails, as a device out of memory would)
        tries.append(offset)
        if len(tries) == 1:
            raise RuntimeError("out of device memory")
        return real(kv, offset)

    monkeypatch.setattr(pool, "share", share)
    with pytest.raises(RuntimeError, match="out of device memory"):
        eng.decode([DecodeCall("A:", parents=prefix, sampling=GREEDY)])
    assert eng.scheduler.load == {"waiting": 0, "running": 0, "reserved_bytes": 0} and not pool.shared
    assert len(eng.decode([DecodeCall("A:", parents=prefix, sampling=GREEDY)])) == 1 and len(tries) == 2


@pytest.mark.parametrize("home,attention,overlap", [("dense", "sdpa", False), ("paged", "sdpa", False),
                                                    ("paged", "flex", False), ("paged", "sdpa", True)])
def test_kv_on_demand_preempts_and_encodes_again_exactly(checkpoint, home, attention, overlap):
    """kv_on_demand: with a pool for about two calls' max_tokens, six calls run at once on the blocks they hold,
    growing as they decode; when the pool runs dry the call admitted last is preempted and encoded again later.
    Every call's tokens (greedy and seeded sampling, fp32) are those it gives alone on an engine that reserves
    up front, its stored KV matches within fp32 noise, and everything is handed back at the end. With either KV
    home (paged: the work budget is the same, the stored answers hold blocks beside it), and with attention read in
    place (flex: blocks handed back and taken again by other calls while a call's page table grows), and with
    overlap (a step that may have to preempt waits for the one in flight: a request with rows in it cannot be)."""
    path = checkpoint("llama")
    spec = Engine(EngineConfig(path)).spec
    per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4
    upfront = Engine(EngineConfig(path, kv_on_demand=False, kv_home=home))
    tight = Engine(EngineConfig(path, kv_budget_bytes=120 * per_token, kv_block_tokens=4, kv_home=home,
                                attention=attention, overlap=overlap))
    calls = [(f"User: request {i}, {'with more words ' * (i % 3)}go.",
              SamplingParams(max_tokens=48, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.9, seed=i)) for i in range(6)]

    def run(eng: Engine, text: str, sampling: SamplingParams):
        prefix = eng.prefill([PrefillCall(text)])
        (mid,) = eng.decode([DecodeCall("Assistant:", parents=prefix, sampling=sampling)])
        msg = eng.message(mid)
        return list(msg.token_ids), msg.kv.read()

    alone = [run(upfront, *c) for c in calls]
    assert upfront.scheduler.preemptions == 0
    together = concurrently(lambda t, s: run(tight, t, s), calls)
    assert tight.scheduler.preemptions > 0
    for (want_tokens, want_kv), (tokens, kv) in zip(alone, together):
        assert tokens == want_tokens
        torch.testing.assert_close(kv, want_kv, rtol=1e-4, atol=1e-4)
    pool = tight.scheduler.pool
    assert tight.scheduler.load == {"waiting": 0, "running": 0, "reserved_bytes": 0}
    assert pool.free_blocks == pool.blocks - pool.held_blocks  # (held: the blocks the stored answers live in)
    # the same calls, reserving up front on the same pool: nobody is preempted, and fewer run at once
    fixed = Engine(EngineConfig(path, kv_budget_bytes=120 * per_token, kv_block_tokens=4, kv_on_demand=False,
                                kv_home=home))
    assert [t for t, _ in concurrently(lambda t, s: run(fixed, t, s), calls)] == [t for t, _ in alone]
    assert fixed.scheduler.preemptions == 0
    mean_batch = lambda e: e.scheduler.requests_stepped / e.scheduler.steps  # noqa: E731
    assert mean_batch(fixed) < mean_batch(tight)
    # a call that fills the whole pool is admitted (the blocks kept spare never exceed what it could grow by)
    exact = Engine(EngineConfig(path, kv_budget_bytes=40 * per_token, kv_block_tokens=4))
    assert exact.scheduler.pool.work_blocks == 10
    headers = [list(range(5 + 12 * c, 17 + 12 * c)) for c in range(3)]  # 3 x 12 tokens, 1 more each: 39 of 40
    done = exact.decode([DecodeCall(h, sampling=SamplingParams(max_tokens=1, ignore_eos=True)) for h in headers])
    assert [exact.message(m).num_tokens for m in done] == [13, 13, 13]


def test_a_stream_that_may_be_preempted_refuses_to_be_read_while_it_runs(llama_engine):
    """Only a stream made readable (it reserves its max_tokens and is never preempted) gives its KV while it decodes;
    any stream gives it from the store once it has ended."""
    eng = llama_engine
    p = eng.prefill([PrefillCall("User: hi there")])
    stream = eng.decode_stream([DecodeCall("Assistant:", parents=p, sampling=SamplingParams(max_tokens=400,
                                                                                            ignore_eos=True))])
    events = iter(stream)
    next(events)
    with pytest.raises(BraidError, match="readable=True"):
        stream.partial_kv(0, 0, 1)
    stream.close()
    readable = eng.decode_stream([DecodeCall("Assistant:", parents=p, sampling=GREEDY)], readable=True)
    events = iter(readable)
    next(events)
    assert len(readable.partial_kv(0, 0, 2)[0]) == 2
    list(events)
    eng.free(p[0])


def test_a_preempted_call_that_is_cancelled_while_it_waits_hands_everything_back(checkpoint):
    """Once a call has been preempted for KV room (it waits at the head of the queue to be encoded again), closing
    every call ends them all: nothing stored of those stopped midway, nothing pinned, the whole pool free."""
    path = checkpoint("llama")
    spec = Engine(EngineConfig(path)).spec
    per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4
    probe = Engine(EngineConfig(path))
    n, h = len(probe.tokenize("User: go on for a while.")), len(probe.tokenize("Agent 0:"))
    # room for the prefix and two calls' headers and max_tokens: each fits alone, three do not fit together
    eng = Engine(EngineConfig(path, kv_budget_bytes=(n + 2 * (h + 30) + 8) * per_token, kv_block_tokens=4))
    prefix = eng.prefill([PrefillCall("User: go on for a while.")])
    before = set(eng.store.ids())
    long = SamplingParams(max_tokens=30, ignore_eos=True)
    streams = [eng.decode_stream([DecodeCall(f"Agent {i}:", parents=prefix, sampling=long)]) for i in range(3)]
    events = [iter(s) for s in streams]
    deadline = time.monotonic() + 60
    while eng.scheduler.preemptions == 0 and time.monotonic() < deadline:
        for ev in events:
            next(ev, None)
    assert eng.scheduler.preemptions > 0
    for s in streams:
        s.close()
        for mid in s.ids or []:  # (a call that had ended already, stored)
            eng.free(mid)
    assert any(s.ids is None for s in streams)  # (at least one was stopped midway)
    eng.free(prefix[0])  # (unpinned by every call: no MessageInUseError)
    pool = eng.scheduler.pool
    assert eng.scheduler.load == {"waiting": 0, "running": 0, "reserved_bytes": 0}
    assert pool.free_blocks == pool.blocks - pool.held_blocks
    assert set(eng.store.ids()) == before - {prefix[0]}


def test_a_step_reads_its_tokens_at_once():
    """sampling.pick and Picked: every group's tokens in one read, greedy rows their argmax and sampled rows
    drawn on the device from their own generators (so the same seed gives the same token whatever else is in the
    step); groups without logits: None."""
    from braid.engine.sampling import Picked, draw, pick

    def step_tokens(logits, params, gens):
        return Picked([None if x is None else pick(x, p, g) for x, p, g in zip(logits, params, gens)]).read()

    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(2, 50, generator=gen), None, torch.randn(1, 50, generator=gen),
              torch.randn(3, 50, generator=gen)]
    greedy, sampled = SamplingParams(), SamplingParams(temperature=1.0, seed=3)
    seeded = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    params = [[greedy, greedy], [], [greedy], [greedy, sampled, greedy]]
    gens = [[None, None], [], [None], [None, seeded(), None]]
    got = step_tokens(logits, params, gens)
    top = [None if x is None else x.argmax(-1).tolist() for x in logits]
    assert got[:3] == top[:3] and got[3][0::2] == top[3][0::2]
    assert got[3][1] == int(draw(logits[3][1], sampled, seeded()))  # (alone: the same draw)
    assert step_tokens([logits[3]], [params[3]], [[None, seeded(), None]]) == [got[3]]
    assert step_tokens([None, None], [[], []], [[], []]) == [None, None]


def test_a_draw_samples_from_the_distribution_top_p_keeps():
    """sampling.draw (an exponential race on the device): token frequencies follow softmax(logits / temperature),
    and top_p keeps the smallest head of the distribution whose mass reaches it (the top token always)."""
    from braid.engine.sampling import draw

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    gen, n = torch.Generator().manual_seed(0), 20000
    counts = torch.bincount(torch.stack([draw(probs.log(), SamplingParams(temperature=1.0), gen)
                                         for _ in range(n)]), minlength=4) / n
    assert (counts - probs).abs().max() < 0.015
    hot = torch.bincount(torch.stack([draw(probs.log(), SamplingParams(temperature=2.0), gen) for _ in range(n)]),
                         minlength=4) / n
    assert (hot - torch.softmax(probs.log() / 2, -1)).abs().max() < 0.015
    head = torch.bincount(torch.stack([draw(probs.log(), SamplingParams(temperature=1.0, top_p=0.7), gen)
                                       for _ in range(n)]), minlength=4) / n
    assert head[2:].sum() == 0 and abs(head[0] - 0.5 / 0.8) < 0.015
    assert {int(draw(probs.log(), SamplingParams(temperature=1.0, top_p=0.01), gen)) for _ in range(50)} == {0}
    # a temperature however small is greedy in the limit (no overflow); logits that are not finite give -1,
    # which fails the call (Request.advance)
    assert {int(draw(probs.log(), SamplingParams(temperature=1e-38), gen)) for _ in range(20)} == {0}
    for bad in (float("nan"), float("inf")):
        for top_p in (1.0, 0.5):
            assert int(draw(probs.log().index_fill(0, torch.tensor([2]), bad),
                            SamplingParams(temperature=1.0, top_p=top_p), gen)) == -1


def test_only_a_lone_call_that_sees_all_it_holds_is_plain(llama_engine):
    """Request.plain (its decode rows build no mask): one call, yes; parallel calls, or a call beside prefill
    calls of its request (which see less than all the request holds), no. Each stream still gives its tokens."""
    from braid.engine.engine import Sibling

    eng = llama_engine
    ctx, = eng.prefill([PrefillCall("Some context.")])
    n = eng.message(ctx).num_tokens
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    streams = [eng.decode_stream([DecodeCall("Q:", parents=[ctx], sampling=greedy)]),
               eng.decode_stream([DecodeCall("Q:", parents=[ctx], sampling=greedy),
                                  DecodeCall("R:", parents=[ctx], sampling=greedy)]),
               eng.decode_stream([PrefillCall("a b", parents=[ctx], new_offset=n, store=False),
                                  DecodeCall("Q:", parents=[ctx, Sibling(0)], sampling=greedy)])]
    assert [s._request.plain for s in streams] == [True, False, False]
    for s in streams:
        assert len(list(s)) == 3 * len(s.ids)
        for mid in s.ids:
            eng.free(mid)
    eng.free(ctx)


@pytest.mark.parametrize("where,overlap", [("admit", False), ("inputs", False), ("inputs", True)])
def test_a_failed_step_fails_the_requests_it_held_and_the_engine_serves_the_next(checkpoint, monkeypatch, where,
                                                                                 overlap):
    """A step that raises outside any one request's forward (admitting it; building the step's inputs) fails the
    request it held, with a status, instead of leaving its consumer waiting; the next request is served, with the
    same tokens as on a fresh engine. With overlap, the step in flight is dropped with it."""
    from braid.engine import scheduler as scheduler_module
    from braid.engine.errors import StepFailedError

    eng = Engine(EngineConfig(checkpoint("llama"), overlap=overlap))
    prefix = eng.prefill([PrefillCall("User: short.")])
    want = eng.decode([DecodeCall("A:", parents=prefix, sampling=GREEDY)])
    failures, calls, in_flight = [], [], []

    def broken(*args, **kwargs):  # (one call fails, as a bug or a device error would)
        failures.append(where)
        in_flight.append(eng.scheduler._flight is not None)
        raise RuntimeError("step broke")

    target = (eng.scheduler, "_admit") if where == "admit" else (scheduler_module, "_inputs")
    real = getattr(*target)
    fail_at = 2 if overlap else 1  # (with overlap: the second step's, while the first is in flight)
    monkeypatch.setattr(*target, lambda *a, **k: broken() if calls.append(1) or len(calls) == fail_at
                        else real(*a, **k))
    stream, outcome = eng.decode_stream([DecodeCall("A:", parents=prefix, sampling=GREEDY)]), []

    def consume():  # (on a thread: a request the step lost would leave it waiting forever)
        try:
            list(stream)
        except Exception as e:  # noqa: BLE001 - what the consumer hears
            outcome.append(e)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(timeout=60)
    assert not consumer.is_alive(), "the request's consumer was never told its step failed"
    error, = outcome
    assert isinstance(error, StepFailedError if where == "inputs" else RuntimeError) and "step broke" in str(error)
    assert failures == [where] and getattr(error, "code", "INTERNAL") == "INTERNAL" and in_flight == [overlap]
    assert eng.scheduler.load == {"waiting": 0, "running": 0, "reserved_bytes": 0}
    again = eng.decode([DecodeCall("A:", parents=prefix, sampling=GREEDY)])
    assert eng.message(again[0]).token_ids == eng.message(want[0]).token_ids


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_reads_the_device_once(checkpoint, overlap):
    """What waits on the device (a read of a tensor's values on the host: item, tolist, bool, ...) happens once per
    step, for the sampled tokens, and never at commit (a paged message's blocks are found on the host). Counted
    for every torch call the scheduler's steps make, through a TorchFunctionMode, over parallel prefill and
    decode; on a GPU each such read is a device sync."""
    from collections import Counter

    from torch.overrides import TorchFunctionMode

    reads = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero", "unique"}

    class Count(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in reads:
                self.seen[func.__name__] += 1
            return func(*args, **(kwargs or {}))

    eng = Engine(EngineConfig(checkpoint("llama"), overlap=overlap))
    prefix = eng.prefill([PrefillCall("User: add the partial results of every worker please.")])
    counter, steps, step = Count(), [], eng.scheduler.step

    def counted():
        before = sum(counter.seen.values())
        with counter:
            step()
        steps.append(sum(counter.seen.values()) - before)

    eng.scheduler.step = counted
    ctx = eng.prefill([PrefillCall(t, parents=prefix) for t in ["Part 3.", "Part 4 and 5 then six."]])
    eng.decode([DecodeCall("Worker:", parents=[*prefix, c], sampling=SamplingParams(max_tokens=12, ignore_eos=True))
                for c in ctx])
    assert max(steps) <= 1 and sum(steps) == 12 and set(counter.seen) == {"tolist"}, (steps, counter.seen)
    steps.clear()  # sampled calls beside greedy ones: still one read a step (drawn on the device)
    eng.decode([DecodeCall("Worker:", parents=[*prefix, c], sampling=SamplingParams(
        max_tokens=12, ignore_eos=True, temperature=t, top_p=p, seed=1))
        for c, t, p in zip(ctx * 2, (0, 1, .8, 1), (1, 1, .9, .5))])
    assert max(steps) <= 1 and sum(steps) == 12 and set(counter.seen) == {"tolist"}, (steps, counter.seen)
    from braid.engine.engine import Sibling

    steps.clear()  # a decode request whose prefill calls come first (lead rows: their slots known on the host)
    list(eng.decode_stream([PrefillCall("Part 9 and ten.", parents=prefix, store=False),
                            DecodeCall("Worker:", parents=[*prefix, Sibling(0)],
                                       sampling=SamplingParams(max_tokens=6, ignore_eos=True))]))
    assert max(steps) <= 1 and sum(steps) == 6 and set(counter.seen) == {"tolist"}, (steps, counter.seen)


def _workload(seed):
    """A workflow: a task, two branch contexts, and 1-3 decode calls' sampling (greedy, seeded, stop tokens about
    every dozen tokens, a stop string; max_tokens 1-20)."""
    import random

    rng = random.Random(seed)
    stops = tuple(rng.sample(range(3, 512), 40))
    calls = []
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(["greedy", "seeded", "stop-ids", "stop-ids", "string"])
        calls.append(SamplingParams(
            max_tokens=rng.randint(1, 20), ignore_eos=True, stop_token_ids=stops if kind == "stop-ids" else (),
            temperature=0.9 if kind == "seeded" else 0.0, seed=seed * 10 + i,
            stop=("e",) if kind == "string" else ()))
    return rng.choice([t for t, _ in REQUESTS]), rng.sample(["Part 3.", "One more part.", "x y z"], k=2), calls


def _answers(eng, workflows=8):
    """`workflows` workflows run at once on `eng` (parallel prefills, then decodes reading them): each decode call's
    tokens, stored KV and finish reason; then checks that everything was handed back."""
    def run(task, contexts, samplings):
        prefix = eng.prefill([PrefillCall(task)])
        ctx = eng.prefill([PrefillCall(c, parents=prefix) for c in contexts])
        stream = eng.decode_stream([DecodeCall("Assistant:", parents=[*prefix, ctx[i % 2]], sampling=s)
                                    for i, s in enumerate(samplings)])
        reasons = {e.call: e.finish_reason for e in stream if e.finish_reason}
        return [(eng.message(m).token_ids, eng.message(m).kv.read(), reasons[i]) for i, m in enumerate(stream.ids)]

    answers = concurrently(run, [_workload(seed) for seed in range(workflows)])
    pool = eng.scheduler.pool
    assert eng.scheduler.load == {"waiting": 0, "running": 0, "reserved_bytes": 0}
    assert pool.free_blocks == pool.blocks - pool.held_blocks
    return answers


def _assert_same_answers(got, want):
    assert {"stop", "length"} <= {r for a in want for _, _, r in a}
    for g, w in zip(got, want):
        assert [(t, r) for t, _, r in g] == [(t, r) for t, _, r in w]
        for (_, a, _), (_, b, _) in zip(g, w):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("options", [{}, {"decode_graphs": "eager"}, {"attention": "flex", "kv_block_tokens": 4}])
def test_overlap_answers_as_the_step_by_step_loop(checkpoint, options):
    """With overlap (each step built and launched before the tokens of the one before are read, which its rows read
    on the device), concurrent workflows of parallel prefills and decodes (greedy and seeded sampling, stop tokens,
    stop strings, max_tokens) give the same tokens, finish reasons and stored KV as the step-by-step loop. Calls
    that stop on a stop token while the next step is built have that step's draw discarded (counted), none of its
    rows is encoded, and everything is handed back."""
    answers = {}
    for overlap in (False, True):
        eng = Engine(EngineConfig(checkpoint("llama"), overlap=overlap, **options))
        answers[overlap] = _answers(eng)
        if overlap:
            assert eng.scheduler.discarded > 0  # (stop tokens hit while the next step was in flight)
    _assert_same_answers(answers[True], answers[False])


@pytest.mark.parametrize("options", [{}, {"decode_graphs": "eager", "overlap": True},
                                     {"attention": "flex", "kv_block_tokens": 4}])
def test_compiled_forwards_answer_as_forwards_run_as_they_come(checkpoint, options):
    """With `compile` (the decoder through torch.compile, attention one opaque op per layer), the same concurrent
    workflows give the same tokens, finish reasons and stored KV as forwards run as they come: steps that mix
    prefill chunks and decode rows, decode-only steps (padded to their bucket's shape with decode_graphs "eager"),
    and FlexAttention over the pool. The decoder compiled whole (fullgraph: a graph break would have left it
    uncompiled), and forwards of many row counts ran compiled."""
    want = _answers(Engine(EngineConfig(checkpoint("llama"), **options)))
    eng = Engine(EngineConfig(checkpoint("llama"), compile=True, **options))
    calls, compiled = [], eng.runner.compiled
    eng.runner.compiled = lambda **kw: calls.append(kw["input_ids"].shape[1]) or compiled(**kw)
    _assert_same_answers(_answers(eng), want)
    assert eng.runner.compiled is not None  # (still compiled: nothing failed to compile)
    assert len(set(calls)) > 3 and 1 in calls and max(calls) > 16  # (forwards of many sizes: decode rows, prefills)
    assert eng.runner.compiled_forwards == len(calls)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_compiled_forwards_in_other_families(checkpoint, family):
    """The other model families (attention biases, q/k norms, sliding windows) compile whole too, and answer as
    their forwards run as they come."""
    runs = []
    for compile in (False, True):
        eng = Engine(EngineConfig(checkpoint(family), compile=compile))
        runs.append(_answers(eng, workflows=2))
        assert compile is (eng.runner.compiled is not None)
    _assert_same_answers(runs[1], runs[0])


def test_a_decoder_that_does_not_compile_runs_as_it_comes(checkpoint, caplog, monkeypatch):
    """A model torch.compile cannot take whole (here a graph break in its first layer's MLP, which fullgraph
    refuses) fails at its first compiled forward, before any of it runs: that forward and every later one run as
    they come, with the failure logged, and the tokens are those of an engine that never compiled."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    want = _answers(Engine(EngineConfig(checkpoint("llama"))), workflows=2)
    forward = LlamaMLP.forward

    def breaks(self, x):
        torch._dynamo.graph_break()
        return forward(self, x)

    monkeypatch.setattr(LlamaMLP, "forward", breaks)
    torch._dynamo.reset()  # (a graph of the decoder compiled by an earlier test would be reused, its guards passing)
    eng = Engine(EngineConfig(checkpoint("llama"), compile=True))
    with caplog.at_level("ERROR", logger="braid.engine.model_runner"):
        _assert_same_answers(_answers(eng, workflows=2), want)
    assert eng.runner.compiled is None and eng.runner.compiled_forwards == 0
    assert caplog.text.count("compiling the decoder failed") == 1 and "graph_break" in caplog.text


def test_a_compiled_forward_that_fails_as_it_runs_fails_its_requests(checkpoint, monkeypatch):
    """A compiled forward that fails once it runs (here its attention op) is a failed forward, not a failed
    compile: its requests fail, the decoder stays compiled, and the next request is served compiled."""
    from braid.engine import attention

    eng = Engine(EngineConfig(checkpoint("llama"), compile=True))
    _answers(eng, workflows=1)  # (compiled)
    done = eng.runner.compiled_forwards
    grouped = attention._per_request

    def fails(*args):
        raise RuntimeError("the device failed")

    monkeypatch.setattr(attention, "_per_request", fails)
    with pytest.raises(Exception, match="the device failed"):
        eng.decode([DecodeCall("Worker:", parents=eng.prefill([PrefillCall("Part 7.")]))])
    monkeypatch.setattr(attention, "_per_request", grouped)
    assert eng.runner.compiled is not None
    _answers(eng, workflows=1)
    assert eng.runner.compiled_forwards > done


def test_overlap_reads_a_step_s_tokens_after_launching_the_next(checkpoint):
    """The order that lets the device run while the host works: with overlap, step k's tokens are read after step
    k+1's forward is launched (its rows fed those tokens on the device), once per step; step by step, each step's
    tokens are read before the next forward."""
    from braid.engine import sampling

    order = []
    real_read = sampling.Picked.read

    def read(self):
        order.append("read")
        return real_read(self)

    for overlap in (False, True):
        eng = Engine(EngineConfig(checkpoint("llama"), overlap=overlap))
        prefix = eng.prefill([PrefillCall("User: add the partial results.")])
        forward = eng.runner.step
        eng.runner.step = lambda *a, **k: order.append("forward") or forward(*a, **k)
        order.clear()
        sampling.Picked.read = read
        try:
            eng.decode([DecodeCall("Worker:", parents=prefix, sampling=SamplingParams(max_tokens=6, ignore_eos=True))])
        finally:
            sampling.Picked.read = real_read
        # 7 forwards: the header, then each sampled token fed (the last one too: it gets KV), and 7 reads (the last
        # step samples nothing)
        assert order.count("forward") == 7 and order.count("read") == 7, order
        if overlap:
            assert order == ["forward", "forward"] + ["read", "forward"] * 5 + ["read", "read"], order
        else:
            assert order == ["forward", "read"] * 7, order


def test_a_step_copies_host_values_to_the_device_without_waiting_for_it(checkpoint):
    """Every host value a step sends to the device goes without waiting for the device's queue (engine.host:
    pinned and asynchronous on CUDA, where a plain copy synchronises the stream and a step built while the one
    before runs would wait for it). Checked on CPU through the torch calls Braid's code makes in the steps (the model's
    own code moves only device tensors): no tensor made from host data straight on a device, no `to` a device that
    may block."""
    import os
    import sys

    from torch.overrides import TorchFunctionMode

    import braid

    ours = os.path.dirname(os.path.dirname(os.path.realpath(braid.engine.__file__)))  # (the repository's folders)
    seen = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if torch.compiler.is_compiling():  # (flex attention's own tracing: nothing of ours)
                return func(*args, **kwargs)
            name = getattr(func, "__name__", "")
            where = os.path.realpath(sys._getframe(1).f_code.co_filename)
            if where.startswith(ours) and ".venv" not in where:
                if name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
                    seen.append((name, where, sys._getframe(1).f_lineno))
                if name == "to" and not kwargs.get("non_blocking") and (
                        "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:])):
                    seen.append((name, where, sys._getframe(1).f_lineno))
            return func(*args, **kwargs)

    for options in ({}, {"decode_graphs": "eager"}, {"attention": "flex"}):
        eng = Engine(EngineConfig(checkpoint("llama"), overlap=True, **options))
        prefix = eng.prefill([PrefillCall("User: add the partial results of every worker please.")])
        step = eng.scheduler.step

        def watched():
            with Watch():
                step()

        eng.scheduler.step = watched
        ctx = eng.prefill([PrefillCall(t, parents=prefix) for t in ["Part 3.", "Part 4 and 5 then six."]])
        eng.decode([DecodeCall("Worker:", parents=[*prefix, c], sampling=SamplingParams(max_tokens=5, ignore_eos=True))
                    for c in ctx])
        assert not seen, (options, seen)


def test_a_process_that_exits_as_its_last_calls_end_exits_cleanly(checkpoint):
    """The scheduler's thread is ended at exit, before the interpreter finalizes: a step still freeing its tensors
    when the main thread returns (its consumers were told first) would otherwise abort the process ("terminate
    called without an active exception"; without the fix, about one such process in three did)."""
    import subprocess
    import sys

    script = f"""
import threading
from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
eng = Engine(EngineConfig({checkpoint("llama")!r}))
ctx = eng.prefill([PrefillCall(list(range(3, 67)))])
streams = [eng.decode_stream([DecodeCall([5 + i], parents=ctx, sampling=SamplingParams(max_tokens=16,
                                                                                        ignore_eos=True))])
           for i in range(64)]
threads = [threading.Thread(target=lambda s=s: list(s)) for s in streams]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("graphs", ["off", "eager"])
def test_paged_decode_attention_answers_as_sdpa(checkpoint, graphs, monkeypatch):
    """With `attention: paged` (decode-sized requests' attention reads the pool in place through their slots:
    kernels.paged_decode, here under Triton's interpreter), concurrent workflows give the same tokens, finish
    reasons and stored KV as SDPA over the gathered keys, in forwards run as they come and at the static shapes
    CUDA graphs replay ("eager"); and the kernel did run."""
    from braid.kernels import paged_decode

    want = _answers(Engine(EngineConfig(checkpoint("llama"), decode_graphs=graphs)))
    ran, kernel = [], paged_decode.paged_decode_attention
    monkeypatch.setattr(paged_decode, "paged_decode_attention",
                        lambda *args, **kwargs: ran.append(args[0].shape) or kernel(*args, **kwargs))
    _assert_same_answers(_answers(Engine(EngineConfig(checkpoint("llama"), attention="paged", decode_graphs=graphs))),
                         want)
    assert len({shape[0] for shape in ran}) > 1  # (steps of several requests at once, and of fewer)
