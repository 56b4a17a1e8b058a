"""Exactness of the choreography API against plain transformers on the same checkpoint."""

import os
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from braid.engine import DecodeCall, PrefillCall, SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def reference_greedy(path, ids, n):
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2)
    return out[0, len(ids):].tolist()


def test_linear_history_matches_generate(family_engine):
    eng = family_engine
    history = []
    for turn in ["User: What is the capital of France?", "User: And of Italy, please?"]:
        history += eng.prefill([PrefillCall(turn, parents=history)])
        history += eng.decode([DecodeCall("Assistant:", parents=history, sampling=GREEDY)])
    header = eng.tokenize("Assistant:")
    context = [t for m in history[:-1] for t in eng.message(m).token_ids] + header
    expected = reference_greedy(eng.config.model_path, context, GREEDY.max_tokens)
    assert list(eng.message(history[-1]).token_ids[len(header):]) == expected
    # positions are contiguous along the history
    assert [eng.message(m).offset for m in history] == [0] + [eng.message(m).end for m in history[:-1]]


def test_parallel_decode_equals_separate_decodes(llama_engine):
    eng = llama_engine
    docs = eng.prefill([PrefillCall(t) for t in ["Each branch writes a result.", "Question one asks for a sum.",
                                                  "0 1 2 3 4 5"]])
    calls = [
        DecodeCall("Assistant:", parents=[docs[0]], sampling=SamplingParams(max_tokens=9, ignore_eos=True)),
        DecodeCall("Answer: the", parents=[docs[1], docs[2]], sampling=SamplingParams(max_tokens=14, ignore_eos=True)),
        DecodeCall("=", parents=[docs[2]], offsets=[40], sampling=SamplingParams(max_tokens=5, temperature=0.9,
                                                                                 top_p=0.8, seed=7, ignore_eos=True)),
        DecodeCall("Sum:", parents=[], new_offset=3, sampling=SamplingParams(max_tokens=11, ignore_eos=True)),
    ]
    together = eng.decode(calls)
    alone = [eng.decode([c])[0] for c in calls]
    for a, b in zip(together, alone):
        ma, mb = eng.message(a), eng.message(b)
        assert ma.token_ids == mb.token_ids and ma.offset == mb.offset
        assert (ma.kv.read() - mb.kv.read()).abs().max() < 1e-5


def test_parallel_prefill_equals_separate_prefills(llama_engine):
    eng = llama_engine
    base, = eng.prefill([PrefillCall("User: What is the capital of France?")])
    calls = [PrefillCall("one two three", parents=[base]), PrefillCall("four five", parents=[base], offsets=[7]),
             PrefillCall("six", new_offset=100)]
    for a, b in zip(eng.prefill(calls), [eng.prefill([c])[0] for c in calls]):
        ma, mb = eng.message(a), eng.message(b)
        assert ma.token_ids == mb.token_ids and ma.positions == mb.positions
        assert (ma.kv.read() - mb.kv.read()).abs().max() < 1e-5


def test_prefilled_and_decoded_kv_agree(llama_engine):
    """A decoded message's KV equals prefilling its tokens in the same place (last token included)."""
    eng = llama_engine
    p, = eng.prefill([PrefillCall("User: hello")])
    d, = eng.decode([DecodeCall("Assistant:", parents=[p], sampling=GREEDY)])
    again, = eng.prefill([PrefillCall(list(eng.message(d).token_ids), parents=[p])])
    assert (eng.message(d).kv.read() - eng.message(again).kv.read()).abs().max() < 1e-5


def test_streaming_and_stopping(llama_engine):
    eng = llama_engine
    p, = eng.prefill([PrefillCall("Question one asks for a sum")])
    events = []
    free_run, = eng.decode([DecodeCall("Answer:", parents=[p], sampling=GREEDY)], on_token=events.append)
    generated = list(eng.message(free_run).token_ids[len(eng.tokenize("Answer:")):])
    assert [e.token_id for e in events] == generated
    assert [e.finish_reason for e in events] == [None] * (len(generated) - 1) + ["length"]
    assert [e.message_id for e in events] == [None] * (len(generated) - 1) + [free_run]
    assert "".join(e.text for e in events) == eng.tokenizer.decode(generated)

    stop_token = generated[4]
    first = generated.index(stop_token)
    by_token, = eng.decode([DecodeCall("Answer:", parents=[p], sampling=SamplingParams(
        max_tokens=12, ignore_eos=True, stop_token_ids=(stop_token,)))])
    assert list(eng.message(by_token).token_ids[-first - 1:]) == generated[: first + 1]

    text = eng.tokenizer.decode(generated)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    stream = eng.decode_stream([DecodeCall("Answer:", parents=[p], sampling=SamplingParams(
        max_tokens=12, ignore_eos=True, stop=(stop,)))])
    events = list(stream)
    assert events[-1].finish_reason == "stop" and stop in "".join(e.text for e in events)
    assert len(events) < len(generated)


def test_seeded_sampling_is_reproducible(llama_engine):
    eng = llama_engine
    p, = eng.prefill([PrefillCall("User: hi")])
    params = SamplingParams(max_tokens=16, temperature=1.3, top_p=0.95, seed=123, ignore_eos=True)
    a, b = (eng.decode([DecodeCall("Assistant:", parents=[p], sampling=params)])[0] for _ in range(2))
    assert eng.message(a).token_ids == eng.message(b).token_ids
    greedy, = eng.decode([DecodeCall("Assistant:", parents=[p], sampling=SamplingParams(max_tokens=16,
                                                                                        ignore_eos=True))])
    assert eng.message(a).token_ids != eng.message(greedy).token_ids  # temperature 1.3 on random weights


def test_eos_ends_decoding(checkpoint):
    from braid.engine import Engine, EngineConfig
    eng = Engine(EngineConfig(checkpoint("llama")))
    p, = eng.prefill([PrefillCall("User: hi")])
    first = eng.message(eng.decode([DecodeCall("Assistant:", parents=[p], sampling=GREEDY)])[0]).token_ids
    answer = list(first[len(eng.tokenize("Assistant:")):])
    eng.spec.eos_token_ids = (answer[1],)  # pretend the 2nd answer token is EOS
    events = list(eng.decode_stream([DecodeCall("Assistant:", parents=[p], sampling=SamplingParams(max_tokens=12))]))
    assert len(events) == answer.index(answer[1]) + 1 and events[-1].finish_reason == "stop"


def test_stream_timings_add_up(llama_engine):
    eng = llama_engine
    p, = eng.prefill([PrefillCall("User: hi")])
    start = time.perf_counter()
    stream = eng.decode_stream([DecodeCall("Assistant:", parents=[p], sampling=GREEDY)])
    list(stream)
    wall = time.perf_counter() - start
    t = stream.timings
    assert 0 <= t["assemble"] <= t["first_token"] and t["decode"] >= 0
    assert t["first_token"] + t["decode"] <= wall


@pytest.mark.parametrize("stream", [True, False])
def test_detokenizer_matches_full_decode(llama_engine, stream):
    """Token by token (tokenizers' DecodeStream, or windows of the tokenizer's decode): the deltas add up to the
    whole decode, with a character split over tokens held back until it is whole; the two ways give the same
    deltas."""
    from braid.engine.detokenize import Detokenizer, streams
    tok = llama_engine.tokenizer
    assert streams(tok)  # (the test checkpoints' tokenizers are fast ones)
    ids = tok.encode("Paris, naïve café — 3 + 4 = 7 ✓ done", add_special_tokens=False)
    ids += [5, 200, 17, 300, 44]  # arbitrary ids, as a random model emits them
    d = Detokenizer(tok, stream=stream)
    deltas = [d.add(t) for t in ids]
    text = "".join(deltas) + d.flush()
    assert text == tok.decode(ids) == d.text
    other = Detokenizer(tok, stream=not stream)
    assert [other.add(t) for t in ids] == deltas


def test_partial_kv_while_decoding_equals_final_and_import_round_trips(llama_engine):
    eng = llama_engine
    p, = eng.prefill([PrefillCall("User: hi")])
    stream = eng.decode_stream([DecodeCall("Assistant:", parents=[p], sampling=GREEDY),
                                DecodeCall("Sum:", sampling=SamplingParams(max_tokens=4, ignore_eos=True))],
                               readable=True)
    pieces, shipped = [], 0
    for event in stream:
        encoded = stream.encoded(0)  # (once: it grows while the scheduler runs on)
        if event.call == 0 and encoded - shipped >= 3:  # ship every 3 encoded tokens
            pieces.append(stream.partial_kv(0, shipped, encoded))
            shipped = encoded
    final = eng.message(stream.ids[0])
    pieces.append(stream.partial_kv(0, shipped, final.num_tokens))
    tokens = [t for toks, _ in pieces for t in toks]
    kv = torch.cat([k for _, k in pieces], dim=3)
    assert tuple(tokens) == final.token_ids and torch.equal(kv, final.kv.read())

    copy = eng.import_message(tokens, kv, final.offset, eng.fingerprint, parents=[p])
    again, = eng.decode([DecodeCall("More:", parents=[p, copy], sampling=GREEDY)])
    direct, = eng.decode([DecodeCall("More:", parents=[p, stream.ids[0]], sampling=GREEDY)])
    assert eng.message(again).token_ids == eng.message(direct).token_ids


def test_import_rejects_foreign_or_misshapen_kv(llama_engine):
    from braid.engine.errors import BraidError, FingerprintMismatchError
    eng = llama_engine
    m = eng.message(eng.prefill([PrefillCall("one two")])[0])
    before = eng.store.ids()
    with pytest.raises(FingerprintMismatchError, match="other"):
        eng.import_message(m.token_ids, m.kv.read(), 0, "other")
    with pytest.raises(BraidError, match="shape"):
        eng.import_message(m.token_ids[:-1], m.kv.read(), 0, eng.fingerprint)
    with pytest.raises(BraidError, match="dtype"):
        eng.import_message(m.token_ids, m.kv.read().double(), 0, eng.fingerprint)
    with pytest.raises(BraidError, match="does not fit"):
        eng.import_message(m.token_ids, m.kv.read(), eng.spec.max_positions, eng.fingerprint)
    assert eng.store.ids() == before


def test_decode_sized_masked_queries_on_cuda_run_the_math_kernel_as_sdpa_would(monkeypatch):
    """engine.attention.sdpa: masked queries of at most DECODE_ROWS rows on CUDA skip cuDNN (it rebuilds a graph
    per key length) by calling SDPA's math kernel themselves, with SDPA's own boolean-mask conversion, so the
    result is SDPA's math backend's, bit for bit; everything else goes to SDPA, untouched."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from braid.engine import attention
    from braid.engine.attention import DECODE_ROWS, sdpa, skips_cudnn

    assert skips_cudnn("cuda", 1, True) and skips_cudnn("cuda", DECODE_ROWS, True)
    assert not skips_cudnn("cuda", DECODE_ROWS + 1, True) and not skips_cudnn("cuda", 1, False)
    assert not skips_cudnn("cpu", 1, True)
    sdpa_calls = []
    real = attention.F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda *a, **k: sdpa_calls.append(1) or real(*a, **k))
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for rows in (1, DECODE_ROWS, DECODE_ROWS + 1):
            g = torch.Generator().manual_seed(rows)
            q = torch.randn(1, 8, rows, 16, generator=g).to(device)
            k, v = (torch.randn(1, 2, 40, 16, generator=g).to(device) for _ in range(2))
            mask = (torch.rand(1, 1, rows, 40, generator=g) > 0.3).to(device)
            mask[..., 0] = True  # (every row attends something)
            with sdpa_kernel([SDPBackend.MATH]):
                want = real(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.3)
            sdpa_calls.clear()
            got = sdpa(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.3)
            assert sdpa_calls == ([] if skips_cudnn(device, rows, True) else [1])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
            if device == "cpu":  # the CUDA branch itself, taken here on CPU tensors: SDPA's math backend exactly
                with monkeypatch.context() as m:
                    m.setattr(attention, "skips_cudnn", lambda *_: True)
                    sdpa_calls.clear()
                    assert torch.equal(sdpa(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.3), want)
                    assert sdpa_calls == []


def test_a_large_checkpoint_keeps_its_fingerprint_until_a_file_changes(checkpoint, tmp_path, monkeypatch):
    """fingerprint_checkpoint: from FINGERPRINT_CACHE_MIN_BYTES on, the hash is kept in the cache file, keyed by
    the files' paths, inodes, sizes, mtimes and ctimes, and computed again when one changes (also a rewrite that
    puts the mtime back); smaller checkpoints are not kept, a cache file that cannot be read changes nothing,
    and entries of deleted checkpoints are dropped."""
    import json
    import shutil

    from braid.engine import model as loading

    monkeypatch.setenv("BRAID_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = shutil.copytree(checkpoint("llama"), tmp_path / "ckpt")
    cache = loading.fingerprint_cache_path()
    real = loading.fingerprint_checkpoint(ckpt)
    assert not os.path.exists(cache)  # (a tiny checkpoint is hashed every time)
    monkeypatch.setattr(loading, "FINGERPRINT_CACHE_MIN_BYTES", 0)
    assert loading.fingerprint_checkpoint(ckpt) == real
    read = lambda: json.loads(open(cache).read())  # noqa: E731
    entries = read()
    assert list(entries.values()) == [real]
    with open(cache, "w") as f:  # what the cache says is what it returns, unhashed
        json.dump({k: "kept" for k in entries}, f)
    assert loading.fingerprint_checkpoint(ckpt) == "kept"
    weights = os.path.join(ckpt, "model.safetensors")
    st = os.stat(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a rewritten file: hashed again
    assert loading.fingerprint_checkpoint(ckpt) == real
    assert list(read().values()) == [real]  # (its old entry replaced, not kept beside it)
    with open(cache, "w") as f:
        f.write("{not json")
    assert loading.fingerprint_checkpoint(ckpt) == real and list(read().values()) == [real]
    gone = shutil.copytree(ckpt, tmp_path / "gone")  # an entry whose checkpoint was deleted is dropped
    loading.fingerprint_checkpoint(gone)
    assert len(read()) == 2
    shutil.rmtree(gone)
    entries = read()
    with open(cache, "w") as f:
        json.dump({k: "kept" for k in entries}, f)
    st = os.stat(weights)
    with open(weights, "rb") as f:
        data = f.read()
    time.sleep(0.01)
    with open(weights, "r+b") as f:  # rewritten in place with its modification time put back (cp -p, rsync -a)
        f.write(data)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(weights).st_mtime_ns == st.st_mtime_ns and os.stat(weights).st_size == st.st_size
    assert loading.fingerprint_checkpoint(ckpt) == real  # (its change time moved: hashed again)
    assert list(read().values()) == [real]  # (and the deleted checkpoint's entry went with that write)
    assert not [n for n in os.listdir(os.path.dirname(cache)) if n.startswith(".fingerprints-")]


def test_a_message_encoded_again_from_its_record_matches_the_original(checkpoint, llama_engine):
    """What a session's lineage records (tokens, parents at their offsets, offset) gives the message again on
    another engine of the same weights, under its own id (PrefillCall.id): a decoded message prefilled again has
    the decode's KV within batching noise, and greedy decodes on the two give the same tokens."""
    from braid.engine import Engine, EngineConfig
    from braid.engine.errors import BraidError

    eng, other = llama_engine, Engine(EngineConfig(checkpoint("llama")))
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    task = eng.prefill([PrefillCall("User: hello there", new_offset=3)])
    reply = eng.decode([DecodeCall("A:", parents=task, sampling=greedy)])
    follow = eng.prefill([PrefillCall("User: and then?", parents=[*task, *reply], offsets=[3, None])])
    for mid in [*task, *reply, *follow]:  # (parents first, as a recomputation brings them)
        m = eng.message(mid)
        assert m.unrecorded == ""
        got = other.prefill([PrefillCall(list(m.token_ids), parents=list(m.parents), offsets=list(m.parent_offsets),
                                         new_offset=m.offset, id=mid)])
        assert got == [mid]
        again = other.message(mid)
        assert (again.token_ids, again.offset, again.parents, again.parent_offsets) == \
            (m.token_ids, m.offset, m.parents, m.parent_offsets)
        torch.testing.assert_close(again.kv.read(), m.kv.read(), atol=1e-5, rtol=1e-4)
    probe = [DecodeCall("Q:", parents=[*reply, *follow], sampling=greedy)]
    assert eng.message(eng.decode(probe)[0]).token_ids == other.message(other.decode(probe)[0]).token_ids
    with pytest.raises(BraidError, match="is taken"):
        other.prefill([PrefillCall("x", id=task[0])])


def test_a_message_records_what_shaped_it_beyond_its_parents(llama_engine):
    """A decode that read its parents through a KV transform, or read unstored prefill calls of its request,
    cannot be encoded again from its record alone: its message says so (Message.unrecorded)."""
    from braid.engine.engine import KVTransform, Sibling

    eng = llama_engine
    greedy = SamplingParams(max_tokens=2, ignore_eos=True)
    task = eng.prefill([PrefillCall("User: a task")])
    stream = eng.decode_stream([DecodeCall("A:", parents=task, sampling=greedy)],
                               transform=KVTransform(frozenset(task), lambda msg, kv: kv))
    list(stream)
    assert "KV transform" in eng.message(stream.ids[0]).unrecorded
    (sib,) = eng.decode([PrefillCall("notes", parents=task, store=False),
                         DecodeCall("B:", parents=[*task, Sibling(0)], sampling=greedy)])
    assert "unstored prefill calls" in eng.message(sib).unrecorded
    (plain,) = eng.decode([DecodeCall("C:", parents=task, sampling=greedy)])
    assert eng.message(plain).unrecorded == ""


def test_a_decoded_message_encoded_again_with_its_context_and_transform_matches(llama_engine):
    """A decode that read an unstored context (a Sibling) and its parents through a KV transform, on an adapter-less
    engine: one prefill of its tokens, with the same unstored context first and the same transform, encodes the
    same KV (within the batched-vs-alone tolerance), and a greedy decode after either gives the same tokens. Two
    such messages encode again in one request. The unstored calls are refused anywhere but first."""
    from braid.engine.engine import KVTransform, Sibling
    from braid.engine.errors import BraidError

    eng = llama_engine
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    task = eng.prefill([PrefillCall("User: a task")])
    halve = KVTransform(frozenset(task), lambda msg, kv: kv * 0.5)  # (a mapper that changes what is read)
    made = []
    for notes in ("notes one", "the second notes"):
        stream = eng.decode_stream([PrefillCall(notes, parents=task, store=False),
                                    DecodeCall("A:", parents=[*task, Sibling(0)], sampling=greedy)], transform=halve)
        list(stream)
        made.append((notes, eng.message(stream.ids[0])))
    calls = [PrefillCall(notes, parents=task, store=False) for notes, _ in made]
    calls += [PrefillCall(list(m.token_ids), parents=[*task, Sibling(i)], new_offset=m.offset, id=f"again-{i}")
              for i, (_, m) in enumerate(made)]
    assert eng.prefill(calls, transform=halve) == ["again-0", "again-1"]
    for i, (_, m) in enumerate(made):
        again = eng.message(f"again-{i}")
        assert (again.token_ids, again.offset) == (m.token_ids, m.offset)
        torch.testing.assert_close(again.kv.read(), m.kv.read(), atol=1e-5, rtol=1e-4)
        after = [eng.decode([DecodeCall("Q:", parents=[mid], sampling=greedy)])[0] for mid in (m.id, again.id)]
        assert eng.message(after[0]).token_ids == eng.message(after[1]).token_ids
    unmapped = eng.prefill([calls[0], PrefillCall(list(made[0][1].token_ids), parents=[*task, Sibling(0)],
                                                  new_offset=made[0][1].offset)])
    assert not torch.allclose(eng.message(unmapped[0]).kv.read(), made[0][1].kv.read(), atol=1e-3)  # (it mattered)
    with pytest.raises(BraidError, match="not stored is read by the calls after it"):
        eng.prefill([PrefillCall("x", parents=task), PrefillCall("y", store=False)])
    with pytest.raises(BraidError, match="not stored is read by the calls after it"):
        eng.prefill([PrefillCall("y", store=False)])


@pytest.mark.parametrize("home", ["dense", "paged"])
def test_the_engine_counts_the_kv_it_copies(checkpoint, home):
    """Engine.kv_copied (exported as a metric and in benchmark JSON): with a dense home, a call's KV copied out
    into its message at commit; with the paged home (the pool), nothing at commit, nor for a parent read in place.
    Either way, a parent read at another offset than it was encoded at is copied (re-rotated) into the pool."""
    from braid.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(checkpoint("llama"), kv_home=home))
    dense, three = home == "dense", SamplingParams(max_tokens=3, ignore_eos=True)
    before = eng.kv_copied
    (p,) = eng.prefill([PrefillCall(list(range(3, 43)))])
    after = eng.kv_copied
    assert after["commit"] - before["commit"] == dense * eng.message(p).nbytes and after["reuse"] == before["reuse"]
    (d,) = eng.decode([DecodeCall("A:", parents=[p], offsets=[7], sampling=three)])
    got = eng.kv_copied
    assert got["reuse"] - after["reuse"] == eng.message(p).nbytes  # (its 40 tokens, moved 7 positions)
    assert got["commit"] - after["commit"] == dense * eng.message(d).nbytes
    (e,) = eng.decode([DecodeCall("B:", parents=[p], sampling=three)])  # (where it was encoded)
    last = eng.kv_copied
    assert last["reuse"] - got["reuse"] == dense * eng.message(p).nbytes  # (a dense one: its one run, copied in)
    assert last["commit"] - got["commit"] == dense * eng.message(e).nbytes


def test_the_paged_home_answers_as_the_dense_one_bit_for_bit(checkpoint):
    """kv_home paged (stored messages live in the pool, read in place where they were encoded) against dense
    (each message a tensor of its own, copied in and out): the same tokens and the same stored KV, bit for bit,
    through parallel prefill and decode, parents read in place and moved, views and prefix-cache hits; and
    freeing every message hands every block back."""
    from braid.engine import Engine, EngineConfig
    from braid.engine.store import DenseKV, PagedKV

    def run(home):
        eng = Engine(EngineConfig(checkpoint("llama"), kv_home=home))
        return eng, *_a_workflow_of_every_kind(eng)

    dense, d_ids, d_tokens, d_kv = run("dense")
    paged, p_ids, p_tokens, p_kv = run("paged")
    assert p_tokens == d_tokens
    assert all(torch.equal(a, b) for a, b in zip(d_kv, p_kv))
    assert all(isinstance(dense.message(m).kv, DenseKV) for m in d_ids)
    assert all(isinstance(paged.message(m).kv, PagedKV) for m in p_ids)
    assert all(torch.equal(torch.stack(paged.message(m).kv.keys_values(), dim=1), kv) for m, kv in zip(p_ids, p_kv))
    assert paged.kv_copied["commit"] == 0 and dense.kv_copied["commit"] > 0
    assert paged.kv_copied["reuse"] < dense.kv_copied["reuse"]  # (only the moved parents were copied)
    pool = paged.scheduler.pool
    assert pool.held_blocks > 0 and paged.scheduler.load["reserved_bytes"] == 0
    for m in list(paged.store.ids()):
        paged.free(m)
    assert pool.held_blocks == 0 and pool.free_blocks == pool.blocks and paged.store.used_bytes == 0


@pytest.mark.parametrize("seed,options", [(0, {}), (1, {"kv_block_tokens": 4, "prefix_caching": False})])
def test_random_workflows_answer_alike_on_both_homes(checkpoint, seed, options):
    """Random choreographies (parallel prefills and decodes over random parents at their own or random offsets,
    views, frees) give the same tokens and bit-identical stored KV with the paged home as with the dense one, and
    freeing what is left hands every block back."""
    import random

    from braid.engine import Engine, EngineConfig

    def run(home):
        eng, rng = Engine(EngineConfig(checkpoint("llama"), kv_home=home, **options)), random.Random(seed)
        ids, out = [], []
        for _ in range(14):
            kind = rng.random()
            parents = rng.sample(ids, k=min(len(ids), rng.randint(0, 3)))
            offsets = [rng.choice([None, None, rng.randint(0, 200)]) for _ in parents]
            tokens = lambda most: [rng.randint(3, 200) for _ in range(rng.randint(1, most))]  # noqa: E731
            if kind < 0.35:
                new = eng.prefill([PrefillCall(tokens(40), parents=parents, offsets=offsets)
                                   for _ in range(rng.randint(1, 3))])
            elif kind < 0.8:
                sampling = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True)
                new = eng.decode([DecodeCall(tokens(6), parents=parents, offsets=offsets, sampling=sampling)
                                  for _ in range(rng.randint(1, 3))])
            elif ids and kind < 0.9:
                m = eng.message(rng.choice(ids))
                start = rng.randint(0, m.num_tokens - 1)
                new = [eng.view(m.id, start, rng.randint(start + 1, m.num_tokens))]
            elif ids:
                gone = rng.choice(ids)
                eng.free(gone)
                ids.remove(gone)
                continue
            else:
                continue
            ids += new
            out += [(eng.message(m).token_ids, eng.message(m).kv.read()) for m in new]
        for m in list(eng.store.ids()):
            eng.free(m)
        pool = eng.scheduler.pool
        assert pool.held_blocks == 0 and pool.free_blocks == pool.blocks and eng.store.used_bytes == 0
        return out

    dense, paged = run("dense"), run("paged")
    assert len(dense) >= 10 and [t for t, _ in paged] == [t for t, _ in dense]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(paged, dense))


def test_a_paged_message_read_outside_the_store_keeps_its_blocks_or_is_refused(checkpoint):
    """A paged message held outside the store's lock (a transport shipping it): its blocks stay out of the pool
    while a read of it is in progress, even if it is freed meanwhile, and go back when that read ends; a read
    after that is refused (NOT_FOUND), never served from blocks another call may have written since."""
    from braid.engine import Engine, EngineConfig
    from braid.engine.errors import UnknownMessageError

    eng = Engine(EngineConfig(checkpoint("llama"), prefix_caching=False))  # (no cached twin keeping it)
    (p,) = eng.prefill([PrefillCall(list(range(3, 43)))])
    msg, pool = eng.message(p), eng.scheduler.pool
    want, held = msg.kv.read(), pool.held_blocks
    with msg.kv.allocs[0].reading():  # (a read in progress in another thread)
        eng.free(p)
        assert pool.held_blocks == held and p not in eng.store
    assert pool.held_blocks == held - 3 and pool.free_blocks == pool.blocks  # (40 tokens: 3 blocks of 16)
    with pytest.raises(UnknownMessageError, match="freed or evicted"):
        msg.kv.read()
    (q,) = eng.prefill([PrefillCall(list(range(3, 43)))])
    assert torch.equal(eng.message(q).kv.read(), want)


def _a_workflow_of_every_kind(eng) -> tuple[list[str], list[list[int]], list[torch.Tensor]]:
    """Parallel prefill and decode, parents read in place and moved, a view and a prefix-cache hit: the messages'
    ids, tokens and stored KV."""
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    p = eng.prefill([PrefillCall("User: add the partial results of every worker please.")])
    ctx = eng.prefill([PrefillCall(t, parents=p) for t in ["Part 3.", "Part 4 and 5 then six."]])
    outs = eng.decode([DecodeCall("Worker:", parents=[*p, c], sampling=greedy) for c in ctx])
    moved = eng.decode([DecodeCall("Synth:", parents=[*p, *outs], offsets=[None, 40, 90], sampling=greedy)])
    view = eng.view(outs[1], 2, 6)
    again = eng.prefill([PrefillCall("User: add the partial results of every worker please. And more.")])
    tail = eng.decode([DecodeCall("More:", parents=[view, *again], sampling=greedy)])
    ids = [*p, *ctx, *outs, *moved, view, *again, *tail]
    return ids, [eng.message(m).token_ids for m in ids], [eng.message(m).kv.read() for m in ids]


@pytest.mark.parametrize("home", ["dense", "paged"])
def test_attention_in_place_answers_as_sdpa(checkpoint, home):
    """attention flex (FlexAttention over the pool in place, through page tables) against sdpa (keys gathered out
    of the pool): the same tokens, and the same stored KV within fp32 rounding, with either KV home (paged: parents
    read where they were stored, in blocks other calls wrote beside)."""
    from braid.engine import Engine, EngineConfig

    runs = [_a_workflow_of_every_kind(Engine(EngineConfig(checkpoint("llama"), kv_home=home, attention=attention)))
            for attention in ("sdpa", "flex")]
    (_, tokens, kv), (_, flex_tokens, flex_kv) = runs
    assert flex_tokens == tokens
    assert max((a - b).abs().max().item() for a, b in zip(kv, flex_kv)) < 1e-5
