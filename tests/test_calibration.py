"""The calibration: identity at init, base weights for workers, save/load, fingerprints, and the trainer's
forward against the engine's cache path."""

import dataclasses
import json
import os

import pytest
import torch
from peft import get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

from braid.cli import main
from braid.engine import Engine, EngineConfig, SamplingParams, fan_out
from braid.engine.calibration import CacheMapper, Calibration, LoraSettings, MapperConfig
from braid.engine.errors import FingerprintMismatchError
from braid.engine.model import fingerprint_checkpoint
from braid.engine.synthesis import Placement, synthesize
from braid.kernels import rerotate_keys_torch
from braid.models import REFERENCE_MODEL
from braid.models.chat import WORKER_HEADER, turn
from braid.models.tasks import generate
from braid.train.calibrate import CalibrateConfig, Encoder, synthesizer_logits

REFERENCE_CALIBRATION = os.path.join(REFERENCE_MODEL, "calibration")


def make_calibration(ckpt: str, out, random: bool, fingerprint: str | None = None, rank: int = 0) -> str:
    """A calibration for `ckpt`: at its init (the identity), or with random mapper and LoRA weights."""
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    lora = LoraSettings(rank=4, alpha=8)
    peft_model = get_peft_model(model, lora.peft_config())
    c = model.config
    mapper = CacheMapper(MapperConfig(c.num_hidden_layers, c.num_key_value_heads,
                                      model.model.layers[0].self_attn.head_dim, rank=rank))
    if random:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in [*mapper.parameters(), *(p for n, p in peft_model.named_parameters() if "lora_" in n)]:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    Calibration(mapper, lora, fingerprint or fingerprint_checkpoint(ckpt), "tiny-llama").save(str(out), peft_model)
    return str(out)


def run_workers(engine: Engine, task):
    workers = fan_out(engine, turn("system", task.system), [turn("user", b.context) for b in task.branches],
                      WORKER_HEADER, SamplingParams(max_tokens=6))
    for _ in workers:
        pass
    return workers


def answer(engine: Engine, workers, task, placement, hooks) -> tuple[tuple[int, ...], torch.Tensor]:
    mid = synthesize(engine, workers.ids, task.prompt(), workers.prefix, placement, SamplingParams(max_tokens=6),
                     hooks)
    msg = engine.message(mid)
    out = msg.token_ids, msg.kv.clone()
    engine.free(mid)
    return out


def test_identity_calibration_leaves_cached_synthesis_bit_identical(checkpoint, tmp_path):
    ckpt = checkpoint("llama")
    engine = Engine(EngineConfig(ckpt, calibration=make_calibration(ckpt, tmp_path / "cal", random=False)))
    task = generate("chain", 3, 3)
    workers = run_workers(engine, task)
    for placement in (Placement.BRANCH_POINT, Placement.SEQUENTIAL, Placement.NONE):
        tokens, kv = answer(engine, workers, task, placement, None)
        tokens_cal, kv_cal = answer(engine, workers, task, placement, engine.calibration.hooks)
        assert tokens_cal == tokens and torch.equal(kv_cal, kv)
    workers.free()


def test_mapper_scale_commutes_with_rope_and_starts_as_identity():
    mapper = CacheMapper(MapperConfig(2, 2, 8))
    kv = torch.randn(2, 2, 2, 5, 8)
    assert torch.equal(mapper(kv, branch=0, num_branches=3), kv)
    with torch.no_grad():
        mapper.scale_k.normal_()
        mapper.scale_v.normal_()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    delta = torch.arange(5) * 7 - 3
    rotate = lambda x: torch.stack([rerotate_keys_torch(x[:, 0], delta, inv_freq), x[:, 1]], dim=1)  # noqa: E731
    assert torch.allclose(mapper(rotate(kv), num_branches=3), rotate(mapper(kv, num_branches=3)), atol=1e-5)


def test_workers_run_base_weights_while_the_adapter_is_loaded(checkpoint, tmp_path):
    """One engine does both roles (as colocated): workers and branch encodings stay unadapted."""
    ckpt = checkpoint("llama")
    plain = Engine(EngineConfig(ckpt, calibration="none"))
    calibrated = Engine(EngineConfig(ckpt, calibration=make_calibration(ckpt, tmp_path / "cal", random=True)))
    task = generate("vote", 5, 3)
    base = run_workers(plain, task)
    for _ in range(2):  # before and after a calibrated synthesis on the same engine
        got = run_workers(calibrated, task)
        assert [calibrated.message(m).token_ids for m in got.ids] == [plain.message(m).token_ids for m in base.ids]
        for a, b in zip([*got.prefix, *got.contexts, *got.ids], [*base.prefix, *base.contexts, *base.ids]):
            assert torch.equal(calibrated.message(a).kv, plain.message(b).kv)
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


def test_save_load_round_trip(checkpoint, tmp_path):
    ckpt = checkpoint("llama")
    path = make_calibration(ckpt, tmp_path / "cal", random=True, rank=2)
    loaded = Calibration.load(path)
    assert loaded.lora == LoraSettings(rank=4, alpha=8) and loaded.mapper.config.rank == 2
    assert loaded.fingerprint == fingerprint_checkpoint(ckpt) and loaded.base_model == "tiny-llama"
    assert sorted(os.listdir(path)) == ["adapter", "calibration.json", "mapper.safetensors"]
    again = tmp_path / "again"
    engine = Engine(EngineConfig(ckpt, calibration=path))
    loaded.save(str(again), engine.calibration.peft_model)
    for name in loaded.mapper.state_dict():
        assert torch.equal(Calibration.load(str(again)).mapper.state_dict()[name], loaded.mapper.state_dict()[name])
    saved = get_peft_model_state_dict(engine.calibration.peft_model)
    assert saved and all(torch.equal(v, get_peft_model_state_dict(Engine(EngineConfig(
        ckpt, calibration=str(again))).calibration.peft_model)[k]) for k, v in saved.items())


def test_another_models_calibration_is_refused(checkpoint, tmp_path):
    ckpt, other = checkpoint("llama"), checkpoint("llama", seed=1)
    path = make_calibration(ckpt, tmp_path / "cal", random=False)
    with pytest.raises(FingerprintMismatchError) as err:
        Engine(EngineConfig(other, calibration=path))
    assert err.value.code == "FAILED_PRECONDITION"
    assert fingerprint_checkpoint(ckpt) in str(err.value) and fingerprint_checkpoint(other) in str(err.value)
    with pytest.raises(ValueError, match="braid calibrate"):
        EngineConfig(ckpt, calibration=str(tmp_path))  # not a calibration directory


def test_trainer_sees_what_the_cache_path_sees(checkpoint):
    """The trainer's no-grad encodings (worker replies the model decodes itself, placed branch KV) and its
    synthesizer forward agree with the engine's workers and cache path."""
    ckpt = checkpoint("llama")
    engine = Engine(EngineConfig(ckpt, calibration="none"))
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="braid")
    cfg = CalibrateConfig(model=ckpt, worker_max_tokens=6)
    encoder = Encoder(model, AutoTokenizer.from_pretrained(ckpt), model.model.rotary_emb.inv_freq.float(), cfg)
    task = generate("chain", 11, 3)
    workers = run_workers(engine, task)
    for placement in (Placement.BRANCH_POINT, Placement.SEQUENTIAL):
        example = encoder.example(task, "synthesis", placement)
        assert torch.allclose(example.prefix_kv, engine.message(workers.prefix[0]).kv, atol=1e-5)
        branch_point = engine.message(workers.prefix[0]).num_tokens
        at = branch_point
        for b, mid in zip(example.branches, workers.ids):
            msg = engine.message(mid)
            off = branch_point if placement is Placement.BRANCH_POINT else at
            keys = rerotate_keys_torch(msg.kv[:, 0], torch.full((msg.num_tokens,), off - msg.offset), encoder.inv_freq)
            assert b.shape == msg.kv.shape  # the reply the model decoded: same tokens as the engine's worker
            assert torch.allclose(b[:, 0], keys, atol=1e-4) and torch.allclose(b[:, 1], msg.kv[:, 1], atol=1e-5)
            at += msg.num_tokens
        tokens, _ = answer(engine, workers, task, placement, None)
        prompt = engine.tokenize(task.prompt())
        target = list(tokens[len(prompt):])
        logits = synthesizer_logits(model, None, [dataclasses.replace(example, target=target)])[0]
        assert logits[len(prompt) - 1:len(prompt) - 1 + len(target)].argmax(-1).tolist() == target
    workers.free()


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
    engine = Engine(EngineConfig(ckpt, calibration=str(out)))
    assert engine.calibration.calibration.lora.rank == 2
    assert main([*args, "--steps", "3", "--branches", "1"]) == 2  # bad input: one clear line

