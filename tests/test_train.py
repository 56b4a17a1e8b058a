"""The training script: reproducible from its seed, and what it writes loads through the engine's path loader."""

import json

from engine import Engine, EngineConfig, PrefillCall
from engine.chat import END, header, turn
from train.train import TrainConfig, train

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
