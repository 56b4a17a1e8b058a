"""Static decode forwards (engine.cuda_graphs): the padded forward against the forward as it comes, what it writes,
what it may not do under a CUDA graph, when it applies; on CUDA, the graphs' replays against it."""

import dataclasses

import pytest
import torch
from test_scheduler import REQUESTS, concurrently, workflow
from torch.utils._python_dispatch import TorchDispatchMode

from braid.engine import Engine, EngineConfig, attention
from braid.engine import cuda_graphs as graphs_module
from braid.engine.cuda_graphs import KEY_STEP, MAX_REQUESTS, bucket, key_bucket
from braid.engine.kv_cache import WorkCache
from braid.engine.model_runner import RequestInput
from braid.methods.calibration import load_engine
from braid.methods.synthesis import Placement
from braid.models.tasks import generate

CUDA = torch.cuda.is_available()


def requests_over(eng: Engine, lengths: list[int], rows: list[int], seed: int) -> list[RequestInput]:
    """One decode request per length: a work cache holding `length` slots of random KV in one segment (the context
    entry) and `rows` parallel calls that see it, each with one new token."""
    gen = torch.Generator().manual_seed(seed)
    pool, dev = eng.scheduler.pool, eng.lm.device
    out = []
    for length, n in zip(lengths, rows):
        cache = WorkCache(eng.lm, length + n, pool, pool.allocate(length + n))
        kv = torch.randn(*pool.kv.shape[:3], length, pool.kv.shape[4], generator=gen)
        cache.append(*kv.to(device=dev, dtype=pool.kv.dtype).unbind(1), segment=0)
        visible = torch.ones(n, 1 + n, dtype=torch.bool, device=dev)
        visible[:, 1:] = torch.eye(n, dtype=torch.bool, device=dev)  # (each call sees its own tokens)
        ids = torch.randint(3, eng.spec.vocab_size, (n,), generator=gen).to(dev)
        of_row = torch.arange(n, device=dev)
        out.append(RequestInput(cache, visible, ids, torch.full((n,), length, device=dev), of_row, list(range(n)),
                                cache.claim(of_row, 1)))
    return out


def as_they_come(eng: Engine, requests: list[RequestInput]) -> list[torch.Tensor | None]:
    """The runner's forward of these requests without its static path."""
    graphs, eng.runner.graphs = eng.runner.graphs, None
    try:
        return eng.runner.step(requests)
    finally:
        eng.runner.graphs = graphs


def release(eng: Engine, requests: list[RequestInput]) -> None:
    for g in requests:
        eng.scheduler.pool.release(g.cache.blocks)


BUDGET = 64 << 20  # the work KV of these tests' engines (on CUDA the default takes half the free memory)


@pytest.fixture(scope="module")
def padded_engine(checkpoint):
    return load_engine(EngineConfig(checkpoint("llama"), decode_graphs="eager", kv_budget_bytes=BUDGET))


def test_config_and_buckets(checkpoint):
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16] and bucket(3, 64) == 64
    assert [key_bucket(n) for n in (1, 65, KEY_STEP, KEY_STEP + 1, 3 * KEY_STEP - 1, 5000)] == [
        64, 128, KEY_STEP, 2 * KEY_STEP, 3 * KEY_STEP, 6144]  # (past 2 * KEY_STEP: steps of a quarter of 2^k)
    with pytest.raises(ValueError, match="decode_graphs 'always' is not one of auto, off, eager"):
        EngineConfig(checkpoint("llama"), decode_graphs="always")
    assert load_engine(EngineConfig(checkpoint("llama"), decode_graphs="off")).runner.graphs is None
    if not CUDA:  # (auto: graphs on CUDA only)
        assert load_engine(EngineConfig(checkpoint("llama"))).runner.graphs is None


def test_which_forwards_are_static(padded_engine, monkeypatch):
    monkeypatch.setattr(graphs_module, "MAX_KEYS", 2048)
    graphs = padded_engine.runner.graphs
    requests = requests_over(padded_engine, [5, 40, 100], [1, 3, 8], 0)
    assert graphs.shape(requests) == (4, 8, 128)  # (G, R, T): 3 requests, 8 rows at most, 108 keys at most
    many = requests_over(padded_engine, [3], [9], 1)  # (more rows than a decode step has: a prefill chunk)
    assert graphs.shape(many) is None
    requests[1].slots = dataclasses.replace(requests[1].slots, lead=range(1))  # (a leading prefill row)
    assert graphs.shape(requests) is None
    assert graphs.shape(requests[:1] * (MAX_REQUESTS + 1)) is None
    long = requests_over(padded_engine, [1023], [1], 2)  # (with its new row: T = 1024)
    assert graphs.shape(long * 2) == (2, 1, 1024) and graphs.shape(long * 3) is None  # (G * T past MAX_KEYS)
    release(padded_engine, requests + many + long)


def test_the_least_recently_used_bucket_goes_first(checkpoint, monkeypatch):
    monkeypatch.setattr(graphs_module, "MAX_BUCKETS", 2)
    eng = load_engine(EngineConfig(checkpoint("llama"), decode_graphs="eager", kv_budget_bytes=BUDGET))
    for lengths in ([10], [100], [10], [300]):  # T: 64, 128, 64 again, 512
        requests = requests_over(eng, lengths, [1], 6)
        eng.runner.step(requests)
        release(eng, requests)
    assert list(eng.runner.graphs.buckets) == [(None, (1, 1, 64)), (None, (1, 1, 512))]


def nan_outside(eng: Engine, requests: list[RequestInput]) -> torch.Tensor:
    """Fill every pool slot the requests' caches do not hold with NaN, but the trash slot (as a pool whose slots
    were used and freed may hold anything); returns the pool as it is then."""
    pool = eng.scheduler.pool
    held = torch.zeros(pool.kv.shape[3], dtype=torch.bool, device=pool.kv.device)
    for g in requests:
        held[g.cache.index[:g.cache.length]] = True
    held[pool.trash:] = True  # (the trash block: zeroed when the pool was made, written only by padding rows)
    pool.kv[..., ~held, :] = float("nan")
    return pool.kv.clone()


@pytest.mark.parametrize("lengths,rows,shape", [([7, 33, 90], [1, 3, 2], (4, 4, 128)),
                                                ([20, 61], [1, 1], (2, 1, 64))])  # (no padding row: G*R rows)
def test_padded_forward_equals_the_forward_as_it_comes(checkpoint, lengths, rows, shape):
    """fp32, requests of other lengths and row counts over a pool whose other slots are NaN, on a new engine
    (nothing written to its trash slot yet): the padded forward runs in the bucket its requests need after their
    new rows, gives the same logits (within rounding) and writes the same KV into each request's slots; outside
    them it writes only the trash slot."""
    eng = load_engine(EngineConfig(checkpoint("llama"), decode_graphs="eager", kv_budget_bytes=BUDGET))
    pool = eng.scheduler.pool
    assert not pool.kv[..., pool.trash:, :].any()  # (a new pool's trash block is zeros, not what memory held)
    a, b = requests_over(eng, lengths, rows, 3), requests_over(eng, lengths, rows, 3)
    before = nan_outside(eng, a + b)
    static = eng.runner.step(a)
    assert next(reversed(eng.runner.graphs.buckets)) == (None, shape)  # (the bucket used last: base weights)
    dynamic = as_they_come(eng, b)
    for s, d in zip(static, dynamic):
        assert s.shape == d.shape and torch.isfinite(s).all() and torch.allclose(s, d, atol=1e-5, rtol=1e-5)
        assert torch.equal(s.argmax(-1), d.argmax(-1))
    for ga, gb in zip(a, b):
        new_a, new_b = ga.slots.write, gb.slots.write
        assert torch.allclose(pool.kv[..., new_a, :], pool.kv[..., new_b, :], atol=1e-5)
    written = torch.cat([g.slots.write for g in a + b] + [torch.tensor([pool.trash], device=pool.kv.device)])
    untouched = torch.ones(pool.kv.shape[3], dtype=torch.bool, device=pool.kv.device)
    untouched[written] = False
    torch.testing.assert_close(pool.kv[..., untouched, :], before[..., untouched, :], rtol=0, atol=0, equal_nan=True)
    release(eng, a + b)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_padded_forward_in_other_families(checkpoint, family):
    """The other model families (attention biases, q/k norms, sliding windows): the padded forward's logits
    are the forward as it comes."""
    eng = load_engine(EngineConfig(checkpoint(family), decode_graphs="eager", kv_budget_bytes=BUDGET))
    a, b = requests_over(eng, [11, 70], [2, 1], 8), requests_over(eng, [11, 70], [2, 1], 8)
    for s, d in zip(eng.runner.step(a), as_they_come(eng, b)):
        assert torch.allclose(s, d, atol=1e-5, rtol=1e-5)
    assert eng.runner.graphs.buckets


def test_the_bucket_is_the_one_the_requests_need_at_its_bounds(padded_engine, monkeypatch):
    """Requests whose keys, with their new rows, exactly fill T, and whose G * T is exactly MAX_KEYS, run static
    in that bucket (their slots are claimed between choosing the bucket and running it)."""
    monkeypatch.setattr(graphs_module, "MAX_KEYS", 128)
    requests = requests_over(padded_engine, [63, 10], [1, 1], 7)
    graphs = padded_engine.runner.graphs
    assert graphs.shape(requests) == (2, 1, 64)
    logits = padded_engine.runner.step(requests)
    assert next(reversed(graphs.buckets)) == (None, (2, 1, 64)) and all(torch.isfinite(x).all() for x in logits)
    release(padded_engine, requests)


def test_static_decodes_give_the_tokens_of_the_forward_as_it_comes(checkpoint, padded_engine):
    """Whole workflows, alone and from many threads at once: the same greedy tokens with static decode
    forwards as without them, and the batched ones did run in buckets of several requests."""
    off = load_engine(EngineConfig(checkpoint("llama"), decode_graphs="off"))
    alone = [workflow(off, task, contexts) for task, contexts in REQUESTS]
    assert [workflow(padded_engine, task, contexts) for task, contexts in REQUESTS] == alone
    assert concurrently(lambda t, c: workflow(padded_engine, t, c), REQUESTS * 2) == alone * 2
    assert any(g > 1 for _, (g, _, _) in padded_engine.runner.graphs.buckets)
    assert padded_engine.scheduler.load == {"waiting": 0, "running": 0, "reserved_bytes": 0}


SYNCS = ("_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "masked_select", "unique")


def test_the_padded_forward_never_waits_for_the_device(padded_engine, monkeypatch):
    """What a CUDA graph cannot hold: no op in the padded forward reads a tensor's value back to the host."""
    seen = set()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    graphs = padded_engine.runner.graphs
    requests = requests_over(padded_engine, [12, 50], [2, 1], 4)
    shape = graphs.shape(requests)
    parts, start = [], 0
    for g in requests:
        parts.append(padded_engine.runner._part(g, start, masked=True))
        start = parts[-1].rows.stop
    bucket = graphs._bucket(shape)
    padded = bucket.step
    padded.load(requests, parts)
    # (as on CUDA: decode-sized masked queries on SDPA's math kernel, which CPU runs too)
    monkeypatch.setattr(attention, "skips_cudnn", lambda *args: True)
    with torch.inference_mode(), Ops():
        graphs._forward(bucket)
    assert {"linear", "index_copy_", "index_select", "_scaled_dot_product_attention_math"} <= seen
    assert not seen & set(SYNCS)
    release(padded_engine, requests)


def test_lora_forwards_have_buckets_of_their_own(checkpoint, tmp_path):
    """A graph replays the weights it was captured with: static forwards under a LoRA (its merged weights
    swapped in) run in buckets of their own, every static forward's bucket names the weights actually in
    place, and calibrated syntheses give the same tokens and KV with static forwards on as off."""
    from test_calibration import answer, make_calibration, run_workers  # (peft, grpc: not on every GPU image)

    ckpt = checkpoint("llama")
    cal = make_calibration(ckpt, tmp_path / "cal", random=True)
    off, padded = (load_engine(EngineConfig(ckpt, calibration=cal, decode_graphs=m)) for m in ("off", "eager"))
    lora = padded.adapters[padded.calibration.hooks.adapter]
    swaps = lora.swaps  # (methods.calibration.MergedLora: the adapted Linears, base and merged weights)
    graphs, run, keys = padded.runner.graphs, padded.runner.graphs.run, []

    def checked(requests, parts, shape, weights=None):
        in_place = [module.weight for module, _, _ in swaps]
        if weights is None:
            assert all(w is base for w, (_, base, _) in zip(in_place, swaps))
        else:
            assert weights == lora and all(w is merged for w, (_, _, merged) in zip(in_place, swaps))
        keys.append(weights)
        return run(requests, parts, shape, weights)

    graphs.run = checked
    task = generate("chain", 3, 3)
    got = [answer(e, run_workers(e, task), task, Placement.BRANCH_POINT, e.calibration.hooks)
           for e in (off, padded)]
    assert got[0][0] == got[1][0] and torch.allclose(got[0][1], got[1][1], atol=1e-5)
    assert None in keys and lora in keys  # (workers' decodes with base weights, the synthesizer's with the LoRA)
    assert {w for w, _ in graphs.buckets} == {None, lora}


def test_turn_lora_forwards_have_buckets_of_their_own(checkpoint, tmp_path):
    """A debate's turns under a random turn LoRA (a second MergedLora beside the synthesizer's): the same turns
    with static forwards as without, the turn LoRA's decode steps static in buckets of their own."""
    from test_turns import make_calibration, turn_tokens  # (peft: not on every GPU image)

    from braid.evals.workflows import graph as task_graph

    ckpt = checkpoint("llama")
    cal = make_calibration(ckpt, tmp_path / "turns", 0.5)
    off, padded = (load_engine(EngineConfig(ckpt, calibration=cal, decode_graphs=m, kv_budget_bytes=BUDGET))
                   for m in ("off", "eager"))
    graph = task_graph(generate("vote", 3, 3), "calibrated+turns", "mad-iter")
    assert turn_tokens(padded, graph) == turn_tokens(off, graph)
    assert padded.adapters[padded.calibration.turns.adapter] in {w for w, _ in padded.runner.graphs.buckets}


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_graph_replays_equal_the_padded_forward(checkpoint):
    """On CUDA: each bucket's captured graph gives bit-identical logits to the padded forward run as it comes,
    and whole workflows the same tokens as without static forwards."""
    graphed, eager, off = (load_engine(EngineConfig(checkpoint("llama"), device="cuda", dtype="float32",
                                                    decode_graphs=mode, kv_budget_bytes=BUDGET))
                           for mode in ("auto", "eager", "off"))
    for seed, (lengths, rows) in enumerate((([7, 33, 90], [1, 3, 2]), ([200], [1]), ([9, 40, 77], [2, 1, 3]))):
        a, b = requests_over(graphed, lengths, rows, seed), requests_over(eager, lengths, rows, seed)
        for x, y in zip(graphed.runner.step(a), eager.runner.step(b)):
            assert torch.equal(x, y)
        release(graphed, a), release(eager, b)
    # (the third in the first one's bucket: its graph replayed over new inputs)
    assert graphed.runner.graphs.captures == 2 and graphed.runner.graphs.replays == 3
    alone = [workflow(off, task, contexts) for task, contexts in REQUESTS]
    assert concurrently(lambda t, c: workflow(graphed, t, c), REQUESTS * 2) == alone * 2
    assert graphed.runner.graphs.replays > 2


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_graphs_under_a_lora_replay_its_weights(checkpoint, tmp_path):
    """On CUDA: calibrated syntheses (a random LoRA, its decode steps replayed from graphs captured under it,
    the workers' from graphs with base weights) give the tokens and KV they give without graphs."""
    from test_calibration import answer, make_calibration, run_workers

    ckpt = checkpoint("llama")
    cal = make_calibration(ckpt, tmp_path / "cal", random=True)
    graphed, off = (load_engine(EngineConfig(ckpt, device="cuda", dtype="float32", calibration=cal, decode_graphs=mode,
                                             kv_budget_bytes=BUDGET)) for mode in ("auto", "off"))
    for seed in range(3):
        task = generate("chain", seed, 3)
        got = [answer(e, run_workers(e, task), task, Placement.BRANCH_POINT, e.calibration.hooks)
               for e in (off, graphed)]
        assert got[0][0] == got[1][0] and torch.allclose(got[0][1], got[1][1], atol=1e-4)
    lora = graphed.adapters[graphed.calibration.hooks.adapter]
    buckets = graphed.runner.graphs.buckets
    assert {w for w, _ in buckets} == {None, lora}
    for weights in (None, lora):  # (both sets of weights replayed from graphs of their own)
        assert any(b.graph is not None and b.replays for (w, _), b in buckets.items() if w == weights)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_compiled_forwards_are_captured_and_replayed(checkpoint):
    """On CUDA, with `compile`: each bucket's graph captures the compiled forward and replays it bit-identically
    (against the same compiled padded forward run as it comes), and whole workflows give the tokens of an engine
    that neither compiles nor captures."""
    graphed, eager, off = (load_engine(EngineConfig(checkpoint("llama"), device="cuda", dtype="float32", compile=c,
                                                    decode_graphs=mode, kv_budget_bytes=BUDGET))
                           for mode, c in (("auto", True), ("eager", True), ("off", False)))
    for seed, (lengths, rows) in enumerate((([7, 33, 90], [1, 3, 2]), ([200], [1]))):
        a, b = requests_over(graphed, lengths, rows, seed), requests_over(eager, lengths, rows, seed)
        for x, y in zip(graphed.runner.step(a), eager.runner.step(b)):
            assert torch.equal(x, y)
        release(graphed, a), release(eager, b)
    graphs = graphed.runner.graphs
    assert graphs.capture and graphs.captures == 2 and graphed.runner.compiled is not None  # (nothing fell back)
    alone = [workflow(off, task, contexts) for task, contexts in REQUESTS]
    assert concurrently(lambda t, c: workflow(graphed, t, c), REQUESTS * 2) == alone * 2
    assert graphs.replays > 2


def test_a_plain_call_s_decode_row_builds_no_mask_and_reads_the_same(padded_engine):
    """One row of a call that sees its whole cache (RequestInput.plain) builds no mask (its part is `full`), and
    gives the logits of the same row with its mask built, bit for bit: beside other requests in the shared attention
    and in the static forward, and alone."""
    eng = padded_engine
    g = requests_over(eng, [12], [1], 1)[0]
    g.plain = True
    part = eng.runner._part(g, 0, masked=True)
    assert part.full and part.mask is None and torch.equal(part.write_index, g.cache.index[g.slots.logical])
    release(eng, [g])
    for lengths, rows in (([9, 40, 21], [1, 2, 1]), ([33], [1])):
        for run in (eng.runner.step, lambda gs: as_they_come(eng, gs)):
            a, b = requests_over(eng, lengths, rows, 5), requests_over(eng, lengths, rows, 5)
            for x in a:
                x.plain = len(x.input_ids) == 1
            for x, y in zip(run(a), run(b)):
                assert torch.equal(x, y)
            release(eng, a + b)


def test_padded_keys_lays_each_part_in_its_row():
    """runner.padded_keys: each part's key slots [start, length) in order in its row of T, the rest `pad`."""
    from types import SimpleNamespace

    from braid.engine.model_runner import _Part, padded_keys

    parts = [_Part(SimpleNamespace(index=torch.tensor(slots), length=len(slots), start=start), slice(0, 1),
                   torch.zeros(1, dtype=torch.long), None) for slots, start in (([5, 6, 7], 0), ([9, 10, 11, 12], 1),
                                                                                ([3], 0))]
    index, inside = padded_keys(parts, 4, pad=99)
    assert index.tolist() == [5, 6, 7, 99, 10, 11, 12, 99, 3, 99, 99, 99]
    assert inside.tolist() == [[True, True, True, False], [True, True, True, False], [True, False, False, False]]


@pytest.mark.skipif(not CUDA, reason="the step path's device waits are CUDA's")
def test_the_step_path_never_synchronizes_the_device(checkpoint, monkeypatch):
    """On CUDA, with overlap off and on, a request's steps (admission, assembly, forwards, commits) never call
    torch.cuda.synchronize: the one wait is each step's token read. Its `assemble` time comes from CUDA events,
    read afterwards on the reader's thread."""
    from braid.engine import DecodeCall, PrefillCall, SamplingParams

    for overlap in (False, True):
        eng = Engine(EngineConfig(checkpoint("llama"), device="cuda", dtype="float32", overlap=overlap))
        parent, = eng.prefill([PrefillCall("a parent the decode call reads")])
        waits = []
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: waits.append(args))
        stream = eng.decode_stream([DecodeCall("go", [parent], sampling=SamplingParams(max_tokens=8,
                                                                                       ignore_eos=True))])
        assert len(list(stream)) == 8 and waits == [], overlap
        assert stream.timings["assemble"] > 0 and stream.timings["decode"] > 0
        monkeypatch.undo()
