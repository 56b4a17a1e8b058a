"""The training script: reproducible from its seed, and what it writes loads through the engine's path loader."""

import json

import torch

from engine import Engine, EngineConfig, PrefillCall
from engine.chat import END, header, turn
from train.train import TrainConfig, batch, load_for_training, task_rng, train

TINY = dict(steps=3, rows=2, row_tokens=320, max_length=2, hidden_size=32, num_layers=1, num_heads=2,
            num_kv_heads=1, intermediate_size=64, vocab_size=400, eval_every=2, bf16=False, device="cpu")


def test_training_is_reproducible_and_loads_by_path(tmp_path):
    first = train(TrainConfig(out=str(tmp_path / "a"), **TINY))
    second = train(TrainConfig(out=str(tmp_path / "b"), **TINY))
    assert first["loss"] == second["loss"] and len(first["loss"]) == 3
    assert [e["step"] for e in first["held_out_accuracy"]] == [2, 3]
    saved = json.loads((tmp_path / "a" / "training.json").read_text())
    assert saved["parameters"] == first["parameters"] and saved["model_bytes"] > 0
    assert (tmp_path / "a" / "loss.png").stat().st_size > 0

    engine = Engine(EngineConfig(str(tmp_path / "a"), device="cpu"))
    tok = engine.tokenizer
    assert engine.spec.eos_token_ids == (tok.convert_tokens_to_ids(END),)
    messages = [{"role": "system", "content": " hi"}, {"role": "worker", "content": " 12 key"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        turn("system", " hi") + turn("worker", " 12 key") + header("synthesizer")
    assert engine.tokenize(turn("worker", " 12")) == [tok.convert_tokens_to_ids("<|worker|>"), *tok.encode(" 12"),
                                                      tok.convert_tokens_to_ids(END)]
    assert engine.prefill([PrefillCall(turn("system", " hi"))])


def test_training_continues_from_a_checkpoint(tmp_path):
    first = train(TrainConfig(out=str(tmp_path / "a"), **TINY))
    more = train(TrainConfig(out=str(tmp_path / "b"), init_from=str(tmp_path / "a"), **{**TINY, "steps": 2}))
    assert more["total_steps"] == 5 and more["parameters"] == first["parameters"]
    assert more["total_train_seconds"] > more["train_seconds"] > 0
    assert [r["loss"] for r in more["earlier_runs"]] == [first["loss"]]
    model, tokenizer, record = load_for_training(str(tmp_path / "a"))  # what the continued run starts from
    saved = Engine(EngineConfig(str(tmp_path / "a"), device="cpu", dtype="float32"))
    assert all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), saved.lm.model.state_dict().values()))
    assert tokenizer.get_vocab() == saved.tokenizer.get_vocab() and record["total_steps"] == 3
    assert Engine(EngineConfig(str(tmp_path / "b"), device="cpu")).tokenizer.get_vocab() == tokenizer.get_vocab()
    cfg = TrainConfig(**TINY)
    first_batch = batch(cfg, tokenizer, task_rng(cfg.seed, 0))[0]
    assert torch.equal(first_batch, batch(cfg, tokenizer, task_rng(cfg.seed, 0))[0])  # a run's stream is its seed's
    assert not torch.equal(first_batch, batch(cfg, tokenizer, task_rng(cfg.seed, 3))[0])  # a continuation's is new
