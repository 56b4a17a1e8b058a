"""The calibration: identity at init, base weights for workers, save/load, fingerprints, and the trainer's
forward against the engine's cache path."""

import dataclasses
import json
import os

import grpc
import pytest
import torch
from peft import get_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

from braid.cli import main
from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.engine.engine import CACHED_PREFIX
from braid.engine.errors import FingerprintMismatchError
from braid.engine.model import fingerprint_checkpoint
from braid.kernels import rerotate_keys_torch
from braid.methods.calibration import (
    CacheMapper,
    Calibration,
    LoraSettings,
    MapperConfig,
    load_engine,
    mode_name,
)
from braid.methods.fanout import fan_out
from braid.methods.synthesis import Placement, Refresh, synthesize, synthesize_stream
from braid.models import REFERENCE_MODEL
from braid.models.chat import END, WORKER_HEADER, turn
from braid.models.tasks import generate
from braid.train.calibrate import CalibrateConfig, Encoder, synthesizer_logits, write_untrained

REFERENCE_CALIBRATION = os.path.join(REFERENCE_MODEL, "calibration")


def make_calibration(ckpt: str, out, random: bool, fingerprint: str | None = None, rank: int = 0) -> str:
    """A calibration for `ckpt`: at its init (the identity), or with random mapper and LoRA weights."""
    return write_untrained(ckpt, str(out), LoraSettings(rank=4, alpha=8), rank, 4, 0.2 if random else 0.0,
                           fingerprint, "tiny-llama")


def run_workers(engine: Engine, task):
    workers = fan_out(engine, turn("system", task.system), [turn("user", b.context) for b in task.branches],
                      WORKER_HEADER, SamplingParams(max_tokens=6))
    for _ in workers:
        pass
    return workers


def answer(engine: Engine, workers, task, placement, hooks, refresh=None) -> tuple[tuple[int, ...], torch.Tensor]:
    mid = synthesize(engine, workers.ids, task.prompt(), workers.prefix, placement, SamplingParams(max_tokens=6),
                     hooks, refresh=refresh)
    msg = engine.message(mid)
    out = msg.token_ids, msg.kv.read().clone()
    engine.free(mid)
    return out


def test_identity_calibration_leaves_cached_synthesis_bit_identical(checkpoint, tmp_path):
    """At its init the mapper leaves cached synthesis bit-identical; the whole calibration at its init (the LoRA
    merged into a copy of the weights: the same values, summed in another order by the matmul kernels) gives
    the same tokens and KV within 1e-6."""
    ckpt = checkpoint("llama")
    engine = load_engine(EngineConfig(ckpt, calibration=make_calibration(ckpt, tmp_path / "cal", random=False)))
    task = generate("chain", 3, 3)
    workers = run_workers(engine, task)
    mapper_only = engine.calibration.without(lora=True)
    for placement in (Placement.BRANCH_POINT, Placement.SEQUENTIAL, Placement.NONE):
        tokens, kv = answer(engine, workers, task, placement, None)
        tokens_mapped, kv_mapped = answer(engine, workers, task, placement, mapper_only)
        assert tokens_mapped == tokens and torch.equal(kv_mapped, kv)
        tokens_cal, kv_cal = answer(engine, workers, task, placement, engine.calibration.hooks)
        assert tokens_cal == tokens and torch.allclose(kv_cal, kv, atol=1e-6)
    workers.free()


def test_compiled_forwards_run_the_base_weights_and_answer_as_without(checkpoint, tmp_path):
    """With `compile`, a calibrated synthesis (the workers on the base weights, the synthesizer under its LoRA,
    whose rows share forwards with base rows) gives the same tokens and KV as without: forwards with the base
    weights in place run compiled, those with the adapter's run as they come (a compiled graph would hold the
    weights it was traced with)."""
    ckpt = checkpoint("llama")
    cal = make_calibration(ckpt, tmp_path / "cal", random=True)
    plain, compiled = (load_engine(EngineConfig(ckpt, calibration=cal, compile=c)) for c in (False, True))
    runner, seen = compiled.runner, []
    forward = runner.forward

    def checked(input_ids, positions, step, weights=None):
        seen.append(weights is None)
        return forward(input_ids, positions, step, weights)

    runner.forward = checked
    task = generate("chain", 3, 3)
    got = [answer(e, run_workers(e, task), task, Placement.BRANCH_POINT, e.calibration.hooks)
           for e in (plain, compiled)]
    assert got[0][0] == got[1][0]
    torch.testing.assert_close(got[0][1], got[1][1], rtol=1e-4, atol=1e-4)
    assert True in seen and False in seen and runner.compiled_forwards == seen.count(True)


def test_mapper_scale_commutes_with_rope_and_starts_as_identity():
    mapper = CacheMapper(MapperConfig(2, 2, 8, branch_slots=2))
    kv = torch.randn(2, 2, 2, 5, 8)
    assert all(torch.equal(mapper(kv.clone(), branch=j, num_branches=3), kv) for j in range(3))
    with torch.no_grad():
        mapper.scale_k.normal_()
        mapper.scale_v.normal_()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    delta = torch.arange(5) * 7 - 3
    rotate = lambda x: torch.stack([rerotate_keys_torch(x[:, 0], delta, inv_freq), x[:, 1]], dim=1)  # noqa: E731
    assert torch.allclose(mapper(rotate(kv), num_branches=3), rotate(mapper(kv.clone(), num_branches=3)), atol=1e-5)
    with torch.no_grad():  # each branch index gets its own shift; indices past the slots share the last one
        mapper.branch_k.normal_()
    first, second = (mapper(kv.clone(), branch=j, num_branches=3) for j in (0, 1))
    assert not torch.allclose(first, second)
    assert torch.equal(mapper(kv.clone(), branch=1, num_branches=3), mapper(kv.clone(), branch=2, num_branches=3))


@pytest.mark.parametrize("rank", [0, 3])
def test_mapper_in_place_serving_path_equals_the_training_path(rank):
    """The engine maps branch KV in place (two passes); the trainer maps out of place, with gradients."""
    mapper = CacheMapper(MapperConfig(3, 2, 8, rank=rank, branch_slots=4))
    with torch.no_grad():
        for p in mapper.parameters():
            p.normal_(std=0.3)
    kv = torch.randn(3, 2, 2, 6, 8)
    for j in (0, 2, 7):
        f = mapper.features(torch.tensor([6]), torch.tensor([5]))
        want = mapper.apply(kv[None], f, torch.tensor([j]))[0]
        assert torch.allclose(mapper(kv.clone(), branch=j, num_branches=5), want, atol=1e-5)


def test_workers_run_base_weights_while_the_adapter_is_loaded(checkpoint, tmp_path):
    """One engine does both roles (as colocated): workers and branch encodings stay unadapted."""
    ckpt = checkpoint("llama")
    plain = load_engine(EngineConfig(ckpt, calibration="none"))
    calibrated = load_engine(EngineConfig(ckpt, calibration=make_calibration(ckpt, tmp_path / "cal", random=True)))
    task = generate("vote", 5, 3)
    base = run_workers(plain, task)
    for _ in range(2):  # before and after a calibrated synthesis on the same engine
        got = run_workers(calibrated, task)
        assert [calibrated.message(m).token_ids for m in got.ids] == [plain.message(m).token_ids for m in base.ids]
        for a, b in zip([*got.prefix, *got.contexts, *got.ids], [*base.prefix, *base.contexts, *base.ids]):
            assert torch.equal(calibrated.message(a).kv.read(), plain.message(b).kv.read())
        _, kv_cal = answer(calibrated, got, task, Placement.BRANCH_POINT, calibrated.calibration.hooks)
        _, kv_plain = answer(plain, base, task, Placement.BRANCH_POINT, None)
        assert not torch.allclose(kv_cal, kv_plain, atol=1e-3)  # the synthesizer's forwards were adapted
        got.free()
    # each part alone changes the synthesis too (the ablations are real)
    for part in (calibrated.calibration.without(mapper=True), calibrated.calibration.without(lora=True)):
        got = run_workers(calibrated, task)
        _, kv_part = answer(calibrated, got, task, Placement.BRANCH_POINT, part)
        assert not torch.allclose(kv_part, kv_cal, atol=1e-3)
        got.free()


@pytest.mark.parametrize("mix, row_safe", [(True, True), (False, True), (True, False)])
def test_base_calls_share_the_synthesizers_forwards_and_stay_unadapted(checkpoint, tmp_path, mix, row_safe):
    """The scheduler puts other requests' base-weight calls in the LoRA's forwards (the adapter reads its merged
    weights on its own rows only), or with mix_adapters off, or an adapter that cannot take rows of other
    calls (`mixes_rows` false: a LoRA on lm_head), gives each its own forwards. Either way, workers decoding
    beside a calibrated synthesis give the tokens and KV they give alone on an uncalibrated engine, and the
    synthesis gives its answer alone, with the same KV."""
    ckpt = checkpoint("llama")
    plain = load_engine(EngineConfig(ckpt, calibration="none"))
    engine = load_engine(EngineConfig(ckpt, calibration=make_calibration(ckpt, tmp_path / "cal", random=True),
                                      mix_adapters=mix))
    hooks, task, other = engine.calibration.hooks, generate("chain", 5, 3), generate("vote", 6, 4)
    assert engine.adapters[hooks.adapter].mixes_rows  # (its targets are the decoder layers')
    engine.adapters[hooks.adapter].mixes_rows = row_safe
    mix = mix and row_safe
    workers, sampling = run_workers(engine, task), SamplingParams(max_tokens=24, ignore_eos=True)
    alone = engine.message(synthesize(engine, workers.ids, task.prompt(), workers.prefix, Placement.BRANCH_POINT,
                                      sampling, hooks))
    base = run_workers(plain, other)
    forwards, run = [], engine.scheduler.run

    def spy(batch, adapter):  # which kinds of call each forward held
        forwards.append({g.adapter is not None for g, _ in batch})
        return run(batch, adapter)

    engine.scheduler.run = spy
    stream = synthesize_stream(engine, workers.ids, task.prompt(), workers.prefix, Placement.BRANCH_POINT,
                               sampling, hooks)
    beside = fan_out(engine, turn("system", other.system), [turn("user", b.context) for b in other.branches],
                     WORKER_HEADER, SamplingParams(max_tokens=6))
    events = iter(stream)
    next(events)  # (the synthesis has started; the workers are submitted while it decodes)
    for _ in beside:
        pass
    rest = list(events)
    assert ({True, False} in forwards) == mix  # base and adapted calls shared forwards
    if not mix:  # (they took turns)
        assert {True} in forwards and {False} in forwards
    assert [engine.message(m).token_ids for m in beside.ids] == [plain.message(m).token_ids for m in base.ids]
    for a, b in zip([*beside.contexts, *beside.ids], [*base.contexts, *base.ids]):
        torch.testing.assert_close(engine.message(a).kv.read(), plain.message(b).kv.read(), rtol=1e-5, atol=1e-5)
    synthesized = engine.message(stream.ids[0])
    assert synthesized.token_ids == alone.token_ids and rest
    torch.testing.assert_close(synthesized.kv.read(), alone.kv.read(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern", ["0000", "1111", "1", "0", "0110", "1010", "0011"])
def test_adapted_rows_read_the_merged_weight_and_the_others_the_base(checkpoint, tmp_path, pattern):
    """MergedLora over some rows of a forward: each row of an adapted linear layer's output is that row alone
    through the merged weight where marked, the base weight where not."""
    ckpt = checkpoint("llama")
    engine = load_engine(EngineConfig(ckpt, calibration=make_calibration(ckpt, tmp_path / "cal", random=True)))
    lora = engine.adapters[engine.calibration.hooks.adapter]
    module, base, merged = lora.swaps[0]
    rows = torch.tensor([c == "1" for c in pattern])
    x = torch.randn(1, len(pattern), module.in_features)
    with lora(rows=rows):
        got = module(x)
    want = torch.stack([torch.nn.functional.linear(x[0, i], merged if r else base) for i, r in enumerate(rows)])
    torch.testing.assert_close(got[0], want, rtol=1e-6, atol=1e-6)
    assert module(x).shape == got.shape and module.weight is base  # (put back as it was)
    assert not torch.allclose(merged, base)


def test_adapted_answers_are_marked_and_refused_as_base_parents(checkpoint, tmp_path):
    """The synthesizer's answer was encoded with the LoRA: it is stored as such, and a base-model call
    refuses it as a parent instead of reading adapted KV as its own."""
    ckpt = checkpoint("llama")
    engine = load_engine(EngineConfig(ckpt, calibration=make_calibration(ckpt, tmp_path / "cal", random=True)))
    task = generate("vote", 2, 2)
    workers = run_workers(engine, task)
    mid = synthesize(engine, workers.ids, task.prompt(), workers.prefix, sampling=SamplingParams(max_tokens=4),
                     hooks=engine.calibration.hooks)
    digest = engine.calibration.record.digest
    assert engine.message(mid).fingerprint == f"{engine.fingerprint}+calibrated:{digest}"
    with pytest.raises(FingerprintMismatchError, match="re-encode its text") as err:
        engine.decode([DecodeCall("more", parents=[mid], sampling=SamplingParams(max_tokens=2))])
    assert err.value.code == "FAILED_PRECONDITION"
    plain = synthesize(engine, workers.ids, task.prompt(), workers.prefix, sampling=SamplingParams(max_tokens=4),
                       hooks=engine.calibration.without(lora=True))  # the mapper alone adapts no weights
    assert engine.message(plain).fingerprint == engine.fingerprint
    engine.free(mid), engine.free(plain), workers.free()


def test_append_rounds_under_the_lora_answer_as_one_adapted_forward(checkpoint, tmp_path):
    """The staircase's append variant with the synthesizer LoRA, in text mode: the chunks are prefilled by the
    base weights, and each round's prompt and answer so far are encoded by the adapted ones. The answer is,
    token for token, what one forward of the adapted weights over the prompt and answer gives after the prefix
    and the chunks (base weights)."""
    from peft import PeftModel

    from braid.methods.staircase import BranchFeed, StaircaseResult, StaircaseSchedule, Variant, staircase
    from braid.methods.synthesis import SynthesisMode

    ckpt = checkpoint("llama")
    engine = load_engine(EngineConfig(ckpt, calibration=make_calibration(ckpt, tmp_path / "cal", random=True)))
    hooks = engine.calibration.without(mapper=True)
    task, prompt, answer = "User: add the parts.", "Synthesizer:", SamplingParams(max_tokens=10, ignore_eos=True)
    workers = fan_out(engine, task, ["Part 3.", "Part 4 and 5."], "W:", SamplingParams(max_tokens=6, ignore_eos=True))
    prefix = engine.prefill([PrefillCall(task)])
    feed, result = BranchFeed([workers]), StaircaseResult()
    list(staircase(engine, feed, prompt, prefix, StaircaseSchedule((10_000,), (4, 3)), Variant.APPEND,
                   SynthesisMode(None, hooks), answer, result=result))
    feed.join()
    last = engine.message(result.message_ids[-1])
    assert last.fingerprint == f"{engine.fingerprint}+{hooks.adapter}" and len(result.rounds) == 3
    chunks = [t for mid in workers.ids for t in engine.message(mid).token_ids]
    body = engine.tokenize(prompt) + result.answer
    base = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="sdpa").eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="sdpa"),
                                        engine.calibration.record.adapter_path).merge_and_unload().eval()
    where = slice(len(body) - len(result.answer) - 1, len(body) - 1)  # (the positions whose logits chose them)
    with torch.no_grad():
        context = torch.tensor([list(engine.message(prefix[0]).token_ids) + chunks])
        logits = adapted(torch.tensor([body]), past_key_values=base(context, use_cache=True).past_key_values).logits
        unadapted = base(torch.tensor([body]), past_key_values=base(context, use_cache=True).past_key_values).logits
    assert logits[0, where].argmax(-1).tolist() == result.answer
    assert unadapted[0, where].argmax(-1).tolist() != result.answer  # (the check can tell the adapter was on)
    engine.free(last.id), workers.free()


def test_bf16_engine_keeps_its_dtypes_and_base_workers(checkpoint, tmp_path):
    """Attaching a calibration moves nothing to another dtype (RoPE's inv_freq stays fp32), so a bf16
    engine's workers are bit-identical to an uncalibrated one's."""
    ckpt = checkpoint("llama")
    plain = load_engine(EngineConfig(ckpt, dtype="bfloat16", calibration="none"))
    calibrated = load_engine(EngineConfig(ckpt, dtype="bfloat16",
                                          calibration=make_calibration(ckpt, tmp_path / "cal", random=True)))
    assert calibrated.lm.model.model.rotary_emb.inv_freq.dtype == plain.lm.model.model.rotary_emb.inv_freq.dtype
    task = generate("vote", 5, 2)
    base, got = run_workers(plain, task), run_workers(calibrated, task)
    for a, b in zip(got.ids, base.ids):
        assert torch.equal(calibrated.message(a).kv.read(), plain.message(b).kv.read())
    tokens, kv = answer(calibrated, got, task, Placement.SEQUENTIAL, calibrated.calibration.hooks)
    assert kv.dtype == torch.bfloat16 and len(tokens) > 0


def test_save_load_round_trip(checkpoint, tmp_path):
    ckpt = checkpoint("llama")
    path = make_calibration(ckpt, tmp_path / "cal", random=True, rank=2)
    loaded = Calibration.load(path)
    assert loaded.lora == LoraSettings(rank=4, alpha=8) and loaded.mapper.config.rank == 2
    assert loaded.mapper.config.branch_slots == 4
    assert loaded.fingerprint == fingerprint_checkpoint(ckpt) and loaded.base_model == "tiny-llama"
    assert sorted(os.listdir(path)) == ["adapter", "calibration.json", "mapper.safetensors"]
    again = tmp_path / "again"
    engine = load_engine(EngineConfig(ckpt, calibration=path))
    loaded.save(str(again), engine.calibration.peft_model)
    for name in loaded.mapper.state_dict():
        assert torch.equal(Calibration.load(str(again)).mapper.state_dict()[name], loaded.mapper.state_dict()[name])
    saved = get_peft_model_state_dict(engine.calibration.peft_model)
    reloaded = load_engine(EngineConfig(ckpt, calibration=str(again))).calibration
    assert saved and all(torch.equal(v, get_peft_model_state_dict(reloaded.peft_model)[k]) for k, v in saved.items())


def test_another_models_calibration_is_refused(checkpoint, tmp_path):
    ckpt, other = checkpoint("llama"), checkpoint("llama", seed=1)
    path = make_calibration(ckpt, tmp_path / "cal", random=False)
    with pytest.raises(FingerprintMismatchError) as err:
        load_engine(EngineConfig(other, calibration=path))
    assert err.value.code == "FAILED_PRECONDITION"
    assert fingerprint_checkpoint(ckpt) in str(err.value) and fingerprint_checkpoint(other) in str(err.value)
    with pytest.raises(ValueError, match="braid calibrate"):
        EngineConfig(ckpt, calibration=str(tmp_path))  # not a calibration directory


def test_trainer_sees_what_the_cache_path_sees(checkpoint):
    """The trainer's no-grad encodings (worker replies the model decodes itself, placed branch KV) and its
    synthesizer forward agree with the engine's workers and cache path."""
    ckpt = checkpoint("llama")
    engine = load_engine(EngineConfig(ckpt, calibration="none", device="cpu"))  # (the trainer's model is on the CPU)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="braid")
    cfg = CalibrateConfig(model=ckpt, worker_max_tokens=6)
    encoder = Encoder(model, AutoTokenizer.from_pretrained(ckpt), model.model.rotary_emb.inv_freq.float(), cfg)
    task = generate("chain", 11, 3)
    workers = run_workers(engine, task)
    for placement in (Placement.BRANCH_POINT, Placement.SEQUENTIAL):
        example = encoder.example(task, "synthesis", placement)
        assert torch.allclose(example.prefix_kv, engine.message(workers.prefix[0]).kv.read(), atol=1e-5)
        branch_point = engine.message(workers.prefix[0]).num_tokens
        at = branch_point
        for b, mid in zip(example.branches, workers.ids):
            msg = engine.message(mid)
            off = branch_point if placement is Placement.BRANCH_POINT else at
            kv = msg.kv.read()
            keys = rerotate_keys_torch(kv[:, 0], torch.full((msg.num_tokens,), off - msg.offset), encoder.inv_freq)
            assert b.shape == kv.shape  # the reply the model decoded: same tokens as the engine's worker
            assert torch.allclose(b[:, 0], keys, atol=1e-4) and torch.allclose(b[:, 1], kv[:, 1], atol=1e-5)
            at += msg.num_tokens
        tokens, _ = answer(engine, workers, task, placement, None)
        prompt = engine.tokenize(task.prompt())
        target = list(tokens[len(prompt):])
        logits = synthesizer_logits(model, None, [dataclasses.replace(example, target=target)])[0]
        assert logits[len(prompt) - 1:len(prompt) - 1 + len(target)].argmax(-1).tolist() == target
    workers.free()


@pytest.mark.parametrize("tail", [-1, 2])
def test_trainer_refreshes_branch_boundaries_as_the_cache_path_does(checkpoint, tail):
    """With refresh, the trainer's re-encoded boundary tokens are the engine's refreshed runs (same KV), the
    rest of each branch stays as shipped, and its synthesizer forward gives the engine's refreshed answer; also
    with more tokens refreshed at the end than at the start (--refresh-tail)."""
    from braid.methods.synthesis import place_branches, refresh_branches

    ckpt = checkpoint("llama", initializer_range=0.3)  # (wide weights: the context visibly matters)
    engine = load_engine(EngineConfig(ckpt, calibration="none", device="cpu"))  # (the trainer's model is on the CPU)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="braid")
    cfg = CalibrateConfig(model=ckpt, worker_max_tokens=6, refresh=1, refresh_tail=tail)
    spec = Refresh(1, 1 if tail == -1 else tail)
    assert cfg.refresh_spec == spec
    encoder = Encoder(model, AutoTokenizer.from_pretrained(ckpt), model.model.rotary_emb.inv_freq.float(), cfg)
    task = generate("chain", 11, 3)
    workers = run_workers(engine, task)
    example = encoder.example(task, "synthesis", Placement.SEQUENTIAL)
    msgs = [engine.message(m) for m in workers.ids]
    n = engine.message(workers.prefix[0]).num_tokens
    offsets, _ = place_branches(n, [m.num_tokens for m in msgs], Placement.SEQUENTIAL)
    parts, made = refresh_branches(engine, workers.prefix, msgs, offsets, spec)
    for j, (msg, (where, fixed)) in enumerate(zip(msgs, example.refreshed)):
        assert where.nonzero().flatten().tolist() == [t for a, b in spec.runs(msg.num_tokens) for t in range(a, b)]
        runs = [engine.message(p) for p, off, b in parts
                if b is None and offsets[j] <= off < offsets[j] + msg.num_tokens]
        got = torch.cat([r.kv.read() for r in runs], dim=3)
        assert torch.allclose(fixed[:, :, :, where], got, atol=1e-4)
        assert torch.equal(fixed[:, :, :, ~where], example.branches[j][:, :, :, ~where])
        assert (fixed[:, :, :, 0] - example.branches[j][:, :, :, 0]).abs().max() > 1e-3 or j == 0
    for mid in made:
        engine.free(mid)
    tokens, _ = answer(engine, workers, task, Placement.SEQUENTIAL, None, spec)
    prompt = engine.tokenize(task.prompt())
    target = list(tokens[len(prompt):])
    logits = synthesizer_logits(model, None, [dataclasses.replace(example, target=target)])[0]
    assert logits[len(prompt) - 1:len(prompt) - 1 + len(target)].argmax(-1).tolist() == target
    workers.free()


def test_trainer_places_mixed_as_the_cache_path_does(checkpoint):
    """--placements mixed: worker replies are the sequential example (refreshed the same); branches encoded apart
    (MultiQA's questions) stay at the branch point unrefreshed, and their answer is the one read apart."""
    ckpt = checkpoint("llama", initializer_range=0.3)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="braid")
    cfg = CalibrateConfig(model=ckpt, worker_max_tokens=6, refresh=1, placements="mixed")
    encoder = Encoder(model, AutoTokenizer.from_pretrained(ckpt), model.model.rotary_emb.inv_freq.float(), cfg)
    chain = generate("chain", 11, 3)
    mixed, sequential = (encoder.example(chain, "synthesis", p) for p in (Placement.MIXED, Placement.SEQUENTIAL))
    assert mixed.new_offset == sequential.new_offset and mixed.target == sequential.target
    for a, b, (wa, fa), (wb, fb) in zip(mixed.branches, sequential.branches, mixed.refreshed, sequential.refreshed):
        assert torch.equal(a, b) and torch.equal(wa, wb) and torch.equal(fa, fb) and wa.any()
    multiqa = generate("multiqa", 4, 3)
    apart, point = (encoder.example(multiqa, "synthesis", p) for p in (Placement.MIXED, Placement.BRANCH_POINT))
    n = apart.prefix_kv.shape[3]
    assert apart.new_offset == point.new_offset == n + max(b.shape[3] for b in apart.branches)
    assert all(torch.equal(a, b) for a, b in zip(apart.branches, point.branches))
    assert not any(where.any() for where, _ in apart.refreshed)  # kept as encoded
    assert multiqa.answer_apart() != multiqa.answer  # (this seed's questions are not in sorted order)
    assert apart.target == encoder.ids(multiqa.answer_apart() + END)
    assert point.target == encoder.ids(multiqa.answer + END)


@pytest.mark.parametrize("refresh", [Refresh(1, 1), Refresh(1, 2)])
def test_the_refresh_in_the_synthesizers_prefill_equals_the_refresh_prefilled_first(checkpoint, tmp_path, refresh):
    """The served path encodes the refreshed runs as unstored prefill calls of the synthesizer's own request
    (base weights, the branches unmapped, in the same forward as the prompt under the LoRA); an engine that takes fewer
    parallel calls than that prefills them first, in calls of their own, as before. With a random mapper and
    LoRA (so a run read mapped, or encoded adapted, would show: their KV then differs by 1 or more), both give
    the same answer and KV, and leave nothing behind. (Three layers: in two, the runs' context reaches only their last layer's KV, which the
    answer's stored KV never reads.)"""
    ckpt = checkpoint("llama", initializer_range=0.3, num_hidden_layers=3)
    cal = make_calibration(ckpt, tmp_path / "cal", random=True)
    fused = load_engine(EngineConfig(ckpt, calibration=cal, kv_block_tokens=4))  # (small blocks: some are freed early)
    task = generate("chain", 5, 3)
    workers = run_workers(fused, task)
    runs = sum(len(refresh.runs(fused.message(m).num_tokens)) for m in workers.ids)
    apart = load_engine(EngineConfig(ckpt, calibration=cal, max_parallel_calls=runs))  # (runs + the synthesizer's)
    moved = [apart.import_message(m.token_ids, m.kv.read(), m.offset, m.fingerprint)
             for m in (fused.message(i) for i in [*workers.prefix, *workers.ids])]
    prefix, branches = moved[:len(workers.prefix)], moved[len(workers.prefix):]
    # and in forwards of 3 rows (the runs split over several), over a pool whose unwritten slots are NaN
    chunked = load_engine(EngineConfig(ckpt, calibration=cal, max_batched_tokens=3))
    chunked.scheduler.pool.kv.fill_(float("nan"))
    for mid in [*prefix, *branches]:
        chunked.import_message(apart.message(mid).token_ids, apart.message(mid).kv.read(), apart.message(mid).offset,
                               apart.fingerprint, message_id=mid)
    for hooks in (None, fused.calibration.hooks):
        before = set(fused.store.ids())
        tokens, kv = answer(fused, workers, task, Placement.SEQUENTIAL, hooks, refresh)
        for other in (apart, chunked):
            mid = synthesize(other, branches, task.prompt(), prefix, Placement.SEQUENTIAL,
                             SamplingParams(max_tokens=6), other.calibration.hooks if hooks is not None else None,
                             refresh=refresh)
            assert other.message(mid).token_ids == tokens
            # (within 1e-4: in the fused prefill the LoRA runs unmerged on the prompt's rows, beside base rows)
            torch.testing.assert_close(other.message(mid).kv.read(), kv, rtol=1e-4, atol=1e-4)
        assert {m for m in fused.store.ids() if not m.startswith(CACHED_PREFIX)} <= before  # (views, runs: gone)
    _, plain = answer(fused, workers, task, Placement.SEQUENTIAL, fused.calibration.hooks)
    assert (plain - kv).abs().max() > 1e-3  # (the runs were refreshed: not the plain cache path)
    # once the runs are encoded, the blocks holding what only they read (the unmapped branches) go back
    stream = synthesize_stream(fused, workers.ids, task.prompt(), workers.prefix, Placement.SEQUENTIAL,
                               SamplingParams(max_tokens=6, ignore_eos=True), fused.calibration.hooks, refresh)
    events = iter(stream)
    next(events)
    request, pool = stream._request, fused.scheduler.pool
    unmapped = sum(fused.message(m).num_tokens for m in workers.ids)  # (about: less the runs' own ends)
    assert request.cache.start >= unmapped - 2 * len(workers.ids) and request.cache.front == 0
    freed = request.cache.start // pool.block_tokens  # (a block more may have been taken for the next token)
    assert freed >= 8 and len(request.blocks) <= pool.blocks_for(request.capacity) - freed + 1
    list(events)
    workers.free()


def _trained_with(path: str, **config) -> None:
    """Record in the calibration's manifest that it was trained with these CalibrateConfig fields."""
    with open(os.path.join(path, "calibration.json")) as f:
        manifest = json.load(f)
    manifest["record"] = {"config": config}
    with open(os.path.join(path, "calibration.json"), "w") as f:
        json.dump(manifest, f)


def test_a_calibration_is_served_with_the_refresh_it_was_trained_with(checkpoint, tmp_path):
    """The synthesizer serves a calibration with the boundary refresh it was trained to read (unless the config
    names one), and reports it verified only for that mode, so `auto` ships KV only where the check applies;
    `braid eval --verify` checks that mode by default."""
    from braid.kv.receiver import KVReceiver
    from braid.synthesizer.runner import SynthesisRunner, SynthesizerConfig

    ckpt = checkpoint("llama")
    path = make_calibration(ckpt, tmp_path / "cal", random=False)
    assert Calibration.load(path).refresh == Refresh(1, 1)  # (written untrained: the default)
    for config, expected in [({"refresh": 0}, None), ({"refresh": 2}, Refresh(2, 2)),
                             ({"refresh": 1, "refresh_tail": 5}, Refresh(1, 5)), ({"refresh": 0, "refresh_tail": 3},
                                                                                  Refresh(0, 3))]:
        _trained_with(path, **config)
        assert Calibration.load(path).refresh == expected, config
    Calibration.load(path).record_verification({"mode": "calibrated+refresh0-3", "max_branches": 3})
    engine = load_engine(EngineConfig(ckpt, calibration=path))
    from braid.evals.harness import engine_modes

    names = [m.name for m in engine_modes(engine)]  # the trained refresh, and the default a deployment may pin
    assert "calibrated+refresh0-3" in names and "calibrated+refresh" in names
    receiver = KVReceiver(engine.fingerprint, host="127.0.0.1")
    try:
        served = SynthesisRunner(engine, receiver, None, SynthesizerConfig())
        assert served.refresh == Refresh(0, 3) and served.info().verified_branches == 3
        pinned = SynthesisRunner(engine, receiver, None, SynthesizerConfig(refresh_tokens=1))
        assert pinned.refresh == Refresh(1, 1) and pinned.info().verified_branches == 0  # (a check of another mode)
        off = SynthesisRunner(engine, receiver, None, SynthesizerConfig(refresh_tokens=0))
        assert off.refresh is None
        bare = load_engine(EngineConfig(ckpt, calibration="none"))
        assert SynthesisRunner(bare, receiver, None, SynthesizerConfig()).refresh == Refresh(1, 1)
    finally:
        receiver.stop()
    with pytest.raises(ValueError, match="refresh_tokens"):
        SynthesizerConfig(refresh_tokens=-1)
    # braid eval: the calibrated modes read with that refresh, and --verify checks it unless told otherwise
    assert main(["eval", "--model", ckpt, "--calibration", path, "--tasks", "vote", "--branches", "2",
                 "--samples", "1", "--worker-max-tokens", "3", "--answer-max-tokens", "3",
                 "--modes", "text,calibrated+refresh0-3", "--verify", "--verification", "own"]) == 0
    assert Calibration.load(path).verification["mode"] == "calibrated+refresh0-3"


def test_calibrate_cli_trains_saves_and_resumes(checkpoint, tmp_path):
    ckpt, out = checkpoint("llama"), tmp_path / "cal"
    args = ["calibrate", "--model", ckpt, "--out", str(out), "--tasks-per-step", "2", "--eval-every", "2",
            "--held-out-per-cell", "1", "--worker-max-tokens", "4", "--answer-max-tokens", "4", "--lora-rank", "2"]
    assert main([*args, "--steps", "2"]) == 0
    first = json.load(open(out / "calibration.json"))["record"]
    assert first["steps"] == 2 and len(first["loss"]) == 2 and first["held_out_accuracy"][-1]["step"] == 2
    assert main([*args, "--steps", "3"]) == 0  # resumes at step 2
    record = json.load(open(out / "calibration.json"))["record"]
    assert record["steps"] == 3 and record["loss"][:2] == first["loss"] and (out / "loss.png").stat().st_size > 0
    engine = load_engine(EngineConfig(ckpt, calibration=str(out)))
    assert engine.calibration.record.lora.rank == 2
    assert main([*args, "--steps", "3", "--branches", "1"]) == 2  # bad input: one clear line
    # a run to resume that did not start from --init-from is not silently resumed in its place
    assert main([*args, "--steps", "4", "--init-from", str(out)]) == 2
    assert main([*args, "--steps", "3", "--lora-rank", "4"]) == 2  # nor one of another shape
    assert main([*args, "--steps", "3", "--refresh", "1"]) == 2  # nor one reading another refresh



def test_calibrated_server_ships_kv_by_default_and_answers_through_the_calibration(checkpoint, tmp_path):
    """The agent API on an engine with a calibration verified up to 2 branches of up to 40 tokens: `auto` reuses
    the KV there (the reason names the calibration) and the answer is the calibrated cache path's, token for
    token; with more branches it re-prefills text; branches that turn out longer than 40 tokens are read from
    their text at synthesis, each, and the answer says which."""
    from braid.cluster.inprocess import start_in_process
    from braid.protos import agent_pb2 as pb
    from braid.protos import agent_pb2_grpc
    from braid.runtime.directory import Directory, EmbeddedRedis

    ckpt = checkpoint("llama")
    path = make_calibration(ckpt, tmp_path / "cal", random=True)
    # as if `braid eval --verify` had found it matching text up to 2 branches (this one is random: it would not)
    # (of the mode the synthesizer serves: calibrated, with each branch's first and last token refreshed)
    Calibration.load(path).record_verification({"mode": "calibrated+refresh", "max_branches": 2,
                                                "max_branch_tokens": 40})
    engine = load_engine(EngineConfig(ckpt, calibration=path))
    redis_server = EmbeddedRedis()
    server = start_in_process(engine, Directory.connect(redis_server.url))
    try:
        greedy = pb.Sampling(max_tokens=6, ignore_eos=True)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            events = list(agent_pb2_grpc.AgentServiceStub(channel).RunWorkflow(pb.WorkflowRequest(
                task="User: add the partial results.", branch_prompts=["Part 3.", "Part 4 and 5."],
                synthesis_prompt="Synthesizer:", worker_sampling=greedy, synthesis_sampling=greedy)))
            wider = list(agent_pb2_grpc.AgentServiceStub(channel).RunWorkflow(pb.WorkflowRequest(
                task="User: add the partial results.", branch_prompts=["Part 3.", "Part 4.", "Part 5."],
                synthesis_prompt="Synthesizer:", worker_sampling=greedy, synthesis_sampling=greedy)))
            longer = list(agent_pb2_grpc.AgentServiceStub(channel).RunWorkflow(pb.WorkflowRequest(
                task="User: add the partial results.", branch_prompts=["Part 3.", "Part 4 and 5."],
                synthesis_prompt="Synthesizer:", worker_sampling=pb.Sampling(max_tokens=60, ignore_eos=True),
                synthesis_sampling=greedy)))
            forced = list(agent_pb2_grpc.AgentServiceStub(channel).RunWorkflow(pb.WorkflowRequest(
                task="User: add the partial results.", branch_prompts=["Part 3.", "Part 4 and 5."],
                synthesis_prompt="Synthesizer:", worker_sampling=pb.Sampling(max_tokens=60, ignore_eos=True),
                synthesis_sampling=greedy, transport=pb.TRANSPORT_LOCAL)))
        decision, = [e.decision for e in events if e.HasField("decision")]
        assert decision.transport == pb.TRANSPORT_LOCAL and f"calibration {path}" in decision.reason
        # three branches are beyond what it was verified for: `auto` re-prefills text, and says why
        decision, = [e.decision for e in wider if e.HasField("decision")]
        assert decision.transport == pb.TRANSPORT_TEXT
        assert "only up to 2 branches; this request has 3" in decision.reason
        done = lambda events: [e.done for e in events if e.HasField("done")][0]  # noqa: E731
        assert list(done(events).text_branches) == [] and list(done(wider).text_branches) == [0, 1, 2]
        # branches that may grow longer than any it was verified on: KV still, and each branch that did (both,
        # 60 tokens) is read from its text at synthesis, the answer the in-process cache path's with that limit
        decision, = [e.decision for e in longer if e.HasField("decision")]
        assert decision.transport == pb.TRANSPORT_LOCAL and "longer than the 40 tokens" in decision.reason
        assert list(done(longer).text_branches) == [0, 1]
        assert list(done(forced).text_branches) == []  # a client that asks for KV gets KV for every branch
        answer = [e.synthesis_token.token_id for e in events if e.HasField("synthesis_token")]
        sampling = SamplingParams(max_tokens=6, ignore_eos=True)
        prefix = engine.prefill([PrefillCall("User: add the partial results.")])
        ctx = engine.prefill([PrefillCall(p, parents=prefix) for p in ["Part 3.", "Part 4 and 5."]])
        branches = engine.decode([DecodeCall(WORKER_HEADER, parents=[*prefix, c], sampling=sampling) for c in ctx])
        calibrated = synthesize(engine, branches, "Synthesizer:", prefix, sampling=sampling,
                                hooks=engine.calibration.hooks, refresh=Refresh(1, 1))
        plain = synthesize(engine, branches, "Synthesizer:", prefix, sampling=sampling)
        assert answer == list(engine.message(calibrated).token_ids[-6:])
        assert engine.message(calibrated).token_ids != engine.message(plain).token_ids  # it did change the answer
        long = engine.decode([DecodeCall(WORKER_HEADER, parents=[*prefix, c], sampling=SamplingParams(
            max_tokens=60, ignore_eos=True)) for c in ctx])
        gated = synthesize(engine, long, "Synthesizer:", prefix, sampling=sampling,
                           hooks=engine.calibration.hooks, refresh=Refresh(1, 1, whole_over=40))
        served = [e.synthesis_token.token_id for e in longer if e.HasField("synthesis_token")]
        assert served == list(engine.message(gated).token_ids[-6:])
    finally:
        server.stop()
        redis_server.stop()


def test_a_verification_recorded_in_the_manifest_vouches_for_its_mode_and_weights(checkpoint, tmp_path):
    from braid.evals.harness import TaskResult, verify

    results = [TaskResult("chain", i, m, "", True, correct={"text": True, "calibrated": True})
               for m in (2, 3, 4, 5) for i in range(50)]
    got = verify(results)  # (bands 2-4, 150 each, and 5 joining it: every answer agreeing)
    assert got["max_branches"] == 5
    # recorded in the manifest, read back on load; the weights (and so the digest) are untouched
    path = make_calibration(checkpoint("llama"), tmp_path / "cal", random=False)
    loaded = Calibration.load(path)
    digest = loaded.digest
    assert loaded.verified_branches == 0
    loaded.record_verification(got)
    again = Calibration.load(path)
    assert again.verified_branches == 5 and again.verification == got and again.digest == digest
    # it vouches only for the mode it checked: the calibrated path without a boundary refresh, not with one
    assert again.verified_for(None) == 5 and again.verified_for(Refresh(1, 1)) == 0
    assert mode_name(Refresh(1, 1)) == "calibrated+refresh" and mode_name(Refresh(2, 0)) == "calibrated+refresh2-0"
    assert mode_name(Refresh(1, 1, sequential=True)) == "calibrated+refresh1-1-in-order"  # (no check vouches for it)
    # and only for the weights it checked: a verification recorded for another calibration vouches for nothing
    again.record_verification({**got, "calibration": "0" * 16, "base_fingerprint": again.fingerprint})
    assert again.verified_for(None) == 0
    again.record_verification({**got, "calibration": digest, "base_fingerprint": again.fingerprint})
    assert again.verified_for(None) == 5 and again.verified_placement == again.placement.value


def test_a_named_verification_is_written_beside_the_calibration_and_served_only_when_named(checkpoint, tmp_path,
                                                                                         capsys):
    """`braid eval --verify --verification NAME` writes <calibration>/verifications/NAME.json and leaves the
    calibration's own record (a shipped one's) as it is; a deployment's gate trusts it only where its config names
    it (EngineConfig / ClusterConfig `verification`), and a name that is not recorded is refused, naming it."""
    from braid.cluster.config import ClusterConfig

    ckpt = checkpoint("llama")
    path = make_calibration(ckpt, tmp_path / "cal", random=False)
    shipped = {"mode": "calibrated+refresh", "max_branches": 8, "max_branch_tokens": 18}
    Calibration.load(path).record_verification(shipped)  # (as a shipped calibration records its own)
    manifest = (tmp_path / "cal" / "calibration.json").read_bytes()
    args = ["eval", "--model", ckpt, "--calibration", path, "--tasks", "vote", "--branches", "2", "--samples", "2",
            "--worker-max-tokens", "3", "--answer-max-tokens", "3", "--modes", "text,calibrated+refresh", "--verify"]
    capsys.readouterr()
    assert main(args) == 2  # (no name: refused before anything runs, saying how to name one)
    assert "--verification NAME" in capsys.readouterr().err
    assert main([*args, "--verification", "../up"]) == 2 and "verification '../up'" in capsys.readouterr().err
    assert main([*args[:-1], "--verification", "mine"]) == 2  # (a name without --verify)
    assert main([*args, "--verification", "mine", "--tolerance", "0"]) == 2  # (no sample count could pass)
    assert main([*args, "--verification", "mine", "--json", str(tmp_path / "eval.json")]) == 0
    out = capsys.readouterr().out
    assert "not verifiable: too few samples (2; need 149)" in out and "verification 'mine'" in out
    assert (tmp_path / "cal" / "calibration.json").read_bytes() == manifest  # the calibration's own: untouched
    written = json.loads((tmp_path / "cal" / "verifications" / "mine.json").read_text())
    assert written["mode"] == "calibrated+refresh" and written["max_branches"] == 0 and written["bands"]
    assert written == json.loads((tmp_path / "eval.json").read_text())["verification"]
    # served: the own record by default; the named one where the config names it (and the reasons say which)
    from braid.synthesizer.runner import SynthesisRunner, SynthesizerConfig

    own_engine = load_engine(EngineConfig(ckpt, calibration=path))
    named_engine = load_engine(EngineConfig(ckpt, calibration=path, verification="mine"))
    assert own_engine.calibration.record.verification == shipped
    named = named_engine.calibration.record
    assert named.verification == written and named.verification_name == "mine"
    own_gate, named_gate = (SynthesisRunner(e, None, None, SynthesizerConfig()).info()
                            for e in (own_engine, named_engine))
    assert own_gate.verified_branches == 8 and own_gate.calibration == path
    assert named_gate.verified_branches == 0 and named_gate.calibration == f"{path} (verification mine)"
    config = ClusterConfig(ckpt, calibration=path, verification="mine")
    assert config.engine_config().verification == "mine" and config.engine_config("worker").verification == "own"
    for bad, message in [({"calibration": path, "verification": "theirs"}, "verification 'theirs' is not recorded"),
                         ({"calibration": "none", "verification": "mine"}, "verification 'mine' names"),
                         ({"calibration": path, "verification": "a/b"}, "verification 'a/b' must be")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(ckpt, **bad)
        with pytest.raises(ValueError, match=message):
            ClusterConfig(ckpt, **bad)
    with pytest.raises(ValueError, match="recorded there: mine"):
        Calibration.load(path, "theirs")
    # where nothing can be written beside it (here: `verifications` is a file), the error says what to do
    blocked = make_calibration(ckpt, tmp_path / "blocked", random=False)
    (tmp_path / "blocked" / "verifications").write_text("")
    with pytest.raises(ValueError, match="cannot record verification 'mine'.*copy"):
        Calibration.load(blocked).record_verification(shipped, "mine")


def test_the_committed_verification_is_of_the_committed_weights():
    """The manifest's verification names the calibration and base model it checked, and they are the ones
    committed beside it: the gate's envelope cannot outlive a change of weights."""
    committed = Calibration.load(os.path.join(REFERENCE_MODEL, "calibration"))
    v = committed.verification
    assert v["calibration"] == committed.digest and v["base_fingerprint"] == fingerprint_checkpoint(REFERENCE_MODEL)
    assert v["placement"] == committed.placement.value == "mixed" and v["max_branches"] == 8
    assert committed.verified_for(committed.refresh) == 8


def test_committed_calibration_reproduces_its_recorded_sample():
    """The reference model's committed calibration, loaded by default, answers a fixed sample exactly as
    recorded (`braid eval --modes text,calibrated ... --json calibration/eval_sample.json`)."""
    from braid.evals.harness import EvalConfig, engine_modes, evaluate, report

    recorded = json.load(open(os.path.join(REFERENCE_CALIBRATION, "eval_sample.json")))
    engine = load_engine(EngineConfig(REFERENCE_MODEL, device="cpu", dtype="float32"))  # calibration "auto"
    assert engine.calibration is not None and engine.fingerprint == recorded["fingerprint"]
    assert engine.calibration.record.fingerprint == engine.fingerprint
    cfg = recorded["config"]
    config = EvalConfig(tasks=tuple(cfg["tasks"]), branches=tuple(cfg["branches"]), samples=cfg["samples"],
                        seed=cfg["seed"], length=tuple(cfg["length"]), worker_max_tokens=cfg["worker_max_tokens"],
                        answer_max_tokens=cfg["answer_max_tokens"])
    modes = [m for m in engine_modes(engine) if m.name in recorded["modes"]]
    assert [m.name for m in modes] == recorded["modes"]
    got = report(config, REFERENCE_MODEL, engine.fingerprint, modes, evaluate(engine, config, modes, progress=False))
    assert [r["answers"] for r in got["results"]] == [r["answers"] for r in recorded["results"]]
    accuracy = {(r["task"], r["branches"], r["mode"]): r["accuracy"] for r in got["summary"]}
    assert accuracy == {(r["task"], r["branches"], r["mode"]): r["accuracy"] for r in recorded["summary"]}


def test_a_calibrated_dag_node_reads_its_replies_as_the_served_cache_path(checkpoint, tmp_path):
    """A ToT voter in a `calibrated` graph gives the tokens of synthesis_stream over the same solutions with the
    calibration's mode (mapper, LoRA, its placement); its output is base KV that any later node may read."""
    from braid.methods.dag import DagRun, Edge, Graph, Node, NodeDone, NodeToken
    from braid.methods.synthesis import SynthesisMode, synthesis_stream

    ckpt = checkpoint("llama")
    engine = load_engine(EngineConfig(ckpt, calibration=make_calibration(ckpt, tmp_path / "cal", random=True)))
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    nodes = [Node("system", "System: vote."),
             *[Node(f"s{j}", f"Solution {j}:", role=f"s{j}", sampling=greedy, parents=(Edge("system"),))
               for j in range(3)],
             Node("voter", "Best:", role="v", sampling=greedy,
                  parents=(Edge("system"), *(Edge(f"s{j}") for j in range(3)))),
             Node("after", "Then:", sampling=greedy, parents=(Edge("voter"),))]
    for calibrated in (True, False):
        dag = DagRun(engine, Graph(nodes, calibrated=calibrated))
        events = list(dag)
        voter = [e.token_id for e in events if isinstance(e, NodeToken) and e.node == "voter"]
        # (written untrained, it is read as served by default: a token refreshed at each end)
        mode = SynthesisMode(engine.calibration.record.placement, engine.calibration.hooks, Refresh(1, 1))
        by_hand = synthesis_stream(engine, [dag.outputs[f"s{j}"] for j in range(3)], "Best:", [dag.outputs["system"]],
                                   mode, greedy)
        expected = [e.token_id for e in by_hand]
        engine.free(by_hand.ids[0])
        assert (voter == expected) == calibrated  # (the random calibration changes the answer)
        assert [e.node for e in events if isinstance(e, NodeDone)][-1] == "after"  # (its output is base KV)
        assert engine.message(dag.outputs["voter"]).token_ids[-5:] == tuple(voter)
        dag.free(keep=())


def test_calibrated_graphs_with_staircases_and_without_a_calibration(checkpoint, tmp_path):
    """A node a staircase streams is read as the wave decodes it, so it is not calibrated (found in review:
    the graph crashed and left a decode running); a calibrated graph on a model without a calibration is
    refused, not silently read uncalibrated."""
    from braid.engine.errors import PreconditionError
    from braid.methods.dag import DagRun, Edge, Graph, Node, NodeToken

    ckpt = checkpoint("llama")
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    nodes = [Node("system", "System: vote."),
             *[Node(f"s{j}", f"Solution {j}:", sampling=greedy, parents=(Edge("system"),)) for j in range(2)],
             Node("c", "Best:", sampling=greedy, parents=(Edge("system"), Edge("s0"), Edge("s1"))),
             Node("d", "Other:", sampling=greedy, parents=(Edge("system"), Edge("s0"))),
             Node("s", "Then:", sampling=greedy, staircase=True, parents=(Edge("system"), Edge("c"), Edge("d")))]
    engine = load_engine(EngineConfig(ckpt, calibration=make_calibration(ckpt, tmp_path / "cal", random=True)))
    got = {}
    for calibrated in (True, False):
        dag = DagRun(engine, Graph(nodes, calibrated=calibrated))
        events = list(dag)
        got[calibrated] = [e.token_id for e in events if isinstance(e, NodeToken) and e.node == "c"]
        dag.free(keep=())
    assert got[True] == got[False] and len(got[True]) == 4
    assert engine.scheduler.load["running"] == 0
    plain = load_engine(EngineConfig(ckpt, calibration="none"))
    with pytest.raises(PreconditionError, match="no calibration loaded"):
        list(DagRun(plain, Graph(nodes, calibrated=True)))


def test_the_calibration_progress_bar_shows_the_held_out_check_not_the_loss():
    from braid.train.calibrate import held_out_postfix

    assert held_out_postfix([], 300) == "held-out check at step 300"
    evals = [{"step": 300, "traces": 0.5}, {"step": 600, "traces": 0.925, "chain": 0.5}]
    assert held_out_postfix(evals) == "held-out right traces 92.5% chain 50.0% (step 600)"
