"""The turn LoRA (braid.train.turns, methods.dag): its training contexts are the ones the engine builds, it runs
only in a calibrated graph's turns and only in their own forwards, and it is saved, loaded and refused like the
rest of a calibration."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from braid.cli import main
from braid.engine import Engine, EngineConfig, attention
from braid.engine.errors import FingerprintMismatchError
from braid.evals.workflows import graph as task_graph
from braid.methods.calibration import TURNS_DIR, TURNS_MANIFEST, LoraSettings, load_engine
from braid.methods.dag import DagRun, NodeToken
from braid.models import REFERENCE_MODEL
from braid.models.chat import WORKER_HEADER
from braid.models.tasks import generate
from braid.train.calibrate import Example, synthesizer_logits, write_untrained
from braid.train.turns import TurnData, write_untrained_turns

REFERENCE_TURNS = os.path.join(REFERENCE_MODEL, "calibration", TURNS_DIR)


def make_calibration(ckpt: str, out, turns_scale: float | None, fingerprint: str | None = None,
                     synthesizer: float = 0.0) -> str:
    """A calibration for `ckpt` (its mapper and synthesizer LoRA at their init, or random with `synthesizer`
    as write_untrained's scale), with a turn LoRA (turns_scale 0: at its init, the identity; else every LoRA
    weight drawn from N(0, scale^2)), or without one (None)."""
    cal = write_untrained(ckpt, str(out), LoraSettings(rank=4, alpha=8), scale=synthesizer, name="tiny-llama")
    if turns_scale is not None:
        write_untrained_turns(ckpt, cal, LoraSettings(rank=4, alpha=8), turns_scale, fingerprint)
    return cal


def turn_tokens(engine: Engine, graph) -> dict[str, list[int]]:
    """Each decoding node's streamed tokens, and each output's stored tokens and fingerprint (checked here: base
    KV, and no adapted message left in the store)."""
    run = DagRun(engine, graph)
    got: dict[str, list[int]] = {}
    for ev in run:
        if isinstance(ev, NodeToken):
            got.setdefault(ev.node, []).append(ev.token_id)
    for name, tokens in got.items():
        msg = engine.message(run.outputs[name])
        assert msg.fingerprint == engine.fingerprint  # (base KV: any reader may take it)
        assert list(msg.token_ids[-len(tokens):]) == tokens
    run.free(keep=())
    assert not [m for m in engine.store.ids() if "+" in engine.message(m).fingerprint]
    return got


def test_training_contexts_are_the_ones_the_engine_decoded_from(checkpoint):
    """The turn examples are built from Engine.context_kv: the trainer's forward over a turn's context and its
    header gives, token by token, the reply the engine decoded there (greedy); and an example is made for each
    node that reads another node's reply, with that solver's own lookup as its target."""
    ckpt = checkpoint("llama")
    data = TurnData(ckpt, workers=2)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation=attention.NAME)
    task = generate("chain", 5, 3)
    for workflow in ("mad-iter", "mad-par"):
        graph = task_graph(task, "kv", workflow)
        run = DagRun(data.engine, graph)
        for _ in run:
            pass
        readers = [n for n in graph.nodes if n.sampling is not None and graph.replies(n)]
        assert readers
        for n in readers:
            msg = data.engine.message(run.outputs[n.name])
            header = len(data.engine.tokenize(n.prompt))
            example = Example(data.engine.context_kv(msg.id), [], 0, list(msg.token_ids[:header]),
                              list(msg.token_ids[header:]), msg.offset, None, "turn", task)
            with torch.no_grad():
                logits = synthesizer_logits(model, None, [example])[0]
            reply = list(msg.token_ids[header:])
            assert logits[header - 1:header - 1 + len(reply)].argmax(-1).tolist() == reply
        turns = [n for n in readers if n.prompt == WORKER_HEADER]  # (the final node reads replies too)
        examples = data._graph(task, workflow)  # (the same graph again: the engine decodes it the same way)
        assert len(examples) == len(turns) == len(readers) - 1
        for e, n in zip(examples, turns):
            msg = data.engine.message(run.outputs[n.name])
            assert torch.equal(e.prefix_kv, data.engine.context_kv(msg.id)) and e.new_offset == msg.offset
            assert e.prompt == data.engine.tokenize(WORKER_HEADER) == list(msg.token_ids[:len(e.prompt)])
            assert e.target == data.engine.tokenize(task.branches[int(n.role.removeprefix("solver"))].output
                                                    + "<|end|>")
        run.free(keep=())


def test_turn_lora_runs_only_in_a_calibrated_graphs_turns(checkpoint, tmp_path):
    """At its init the turn LoRA changes nothing (bit-identical turns); a random one changes the turns that read
    other replies and nothing else: not the first speaker, not an uncalibrated graph, not a graph that asks for
    base turns, not the synthesizer LoRA beside it. Every output is stored as base KV, nothing adapted is left."""
    ckpt = checkpoint("llama")
    task = generate("vote", 3, 3)
    g = lambda mode: task_graph(task, mode, "mad-iter")  # noqa: E731
    identity = load_engine(EngineConfig(ckpt, calibration=make_calibration(ckpt, tmp_path / "id", 0.0)))
    assert identity.calibration.turns is not None
    base = turn_tokens(identity, g("calibrated"))  # (calibrated, base turns)
    assert turn_tokens(identity, g("calibrated+turns")) == base
    turns = {k: v for k, v in base.items() if k != "final"}  # (the final node: read through the calibration)
    assert {k: v for k, v in turn_tokens(identity, g("kv")).items() if k != "final"} == turns

    engine = load_engine(EngineConfig(ckpt, calibration=make_calibration(ckpt, tmp_path / "rand", 0.5)))
    assert turn_tokens(engine, g("calibrated")) == base
    assert {k: v for k, v in turn_tokens(engine, g("kv")).items() if k != "final"} == turns
    adapted = turn_tokens(engine, g("calibrated+turns"))
    assert adapted["turn0"] == base["turn0"]  # (it reads no reply: a plain worker)
    assert adapted["turn1"] != base["turn1"] and adapted["turn2"] != base["turn2"]

    # a random synthesizer LoRA answers the same with a turn LoRA loaded beside it (base turns)
    without = load_engine(EngineConfig(ckpt, calibration=make_calibration(ckpt, tmp_path / "s", None, synthesizer=0.2)))
    beside = load_engine(EngineConfig(ckpt, calibration=make_calibration(ckpt, tmp_path / "st", 0.5, synthesizer=0.2)))
    assert turn_tokens(beside, g("calibrated")) == turn_tokens(without, g("calibrated"))
    assert turn_tokens(without, g("calibrated"))["final"] != base["final"]


def test_turn_lora_round_trip_and_fingerprint(checkpoint, tmp_path):
    ckpt = checkpoint("llama")
    cal = make_calibration(ckpt, tmp_path / "ok", 0.3)
    engine = load_engine(EngineConfig(ckpt, calibration=cal))
    manifest = json.load(open(os.path.join(cal, TURNS_DIR, TURNS_MANIFEST)))
    assert engine.calibration.record.turns == manifest and manifest["lora"]["rank"] == 4
    assert engine.calibration.turns.adapter.startswith("turns:")
    assert (load_engine(EngineConfig(ckpt, calibration=make_calibration(ckpt, tmp_path / "none",
                                                                                       None)))).calibration.turns is None
    bad = make_calibration(ckpt, tmp_path / "bad", 0.3, fingerprint="0" * 32)
    with pytest.raises(FingerprintMismatchError, match="turn LoRA"):
        load_engine(EngineConfig(ckpt, calibration=bad))


def test_calibrate_turns_cli_trains_saves_and_resumes(checkpoint, tmp_path):
    ckpt = checkpoint("llama")
    cal = make_calibration(ckpt, tmp_path / "cal", None)
    args = ["calibrate-turns", "--model", ckpt, "--calibration", cal, "--tasks-per-step", "2", "--eval-every", "2",
            "--held-out-per-cell", "1", "--lora-rank", "2", "--solvers", "2", "--tasks", "vote",
            "--workflows", "mad-par"]
    assert main([*args, "--steps", "2"]) == 0
    path = os.path.join(cal, TURNS_DIR, TURNS_MANIFEST)
    first = json.load(open(path))["record"]
    assert first["steps"] == 2 and len(first["loss"]) == 2 and [e["step"] for e in first["held_out_accuracy"]] == [0, 2]
    assert main([*args, "--steps", "3"]) == 0  # resumes at step 2
    record = json.load(open(path))["record"]
    assert record["steps"] == 3 and record["loss"][:2] == first["loss"]
    assert os.path.getsize(os.path.join(cal, TURNS_DIR, "loss.png")) > 0
    assert (load_engine(EngineConfig(ckpt, calibration=cal))).calibration.turns is not None
    assert main([*args, "--steps", "3", "--solvers", "1"]) == 2  # bad input: one clear line
    assert main([*args, "--steps", "3", "--workflows", "tot"]) == 2  # (ToT has no turns)
    assert main([*args, "--steps", "4", "--lora-rank", "4"]) == 2  # a run of another shape is not resumed


@pytest.mark.skipif(not os.path.isfile(os.path.join(REFERENCE_TURNS, "eval_sample.json")),
                    reason="the reference model's turn LoRA has no recorded sample")
def test_committed_turn_lora_reproduces_its_recorded_sample():
    """The reference calibration's turn LoRA, loaded by default, answers a fixed sample of debates exactly as
    recorded (`python -m braid.evals.workflows ... --sample turns/eval_sample.json`)."""
    from braid.evals.workflows import answer

    recorded = json.load(open(os.path.join(REFERENCE_TURNS, "eval_sample.json")))
    engine = load_engine(EngineConfig(REFERENCE_MODEL, device="cpu", dtype="float32"))
    assert engine.calibration.turns is not None and engine.fingerprint == recorded["fingerprint"]
    for row in recorded["rows"]:
        task = generate(row["task"], row["seed"], row["branches"])
        assert list(answer(engine, task, row["mode"], row["workflow"])) == row["answer"], row


def test_workflow_eval_pairs_the_fine_tuned_turns_with_text_and_records_a_sample(checkpoint, tmp_path):
    """`python -m braid.evals.workflows` on a model whose calibration has a turn LoRA: the debates get the
    calibrated+turns mode (ToT, without turns, does not), every answer is recorded, and a replay gives it again."""
    import shutil

    from braid.evals.workflows import answer
    from braid.evals.workflows import main as eval_main

    model = str(tmp_path / "model")
    shutil.copytree(checkpoint("llama"), model)
    make_calibration(model, os.path.join(model, "calibration"), 0.3)
    out, sample = tmp_path / "eval.json", tmp_path / "sample.json"
    assert eval_main(["--model", model, "--workflows", "tot,mad-par", "--tasks", "vote", "--samples", "1",
                      "--branches", "2", "--out", str(out), "--sample", str(sample)]) == 0
    rows = json.load(open(out))["rows"]
    assert [(r["workflow"], r["mode"]) for r in rows] == [
        ("tot", m) for m in ("text", "kv", "staircase", "calibrated")] + [
        ("mad-par", m) for m in ("text", "kv", "staircase", "calibrated", "calibrated+turns")]
    recorded = json.load(open(sample))
    engine = load_engine(EngineConfig(model))
    assert len(recorded["rows"]) == len(rows) and recorded["fingerprint"] == engine.fingerprint
    for row in recorded["rows"][-2:]:
        assert list(answer(engine, generate(row["task"], row["seed"], 2), row["mode"], row["workflow"])) == \
            row["answer"]
    with pytest.raises(SystemExit):
        eval_main(["--model", model, "--modes", "kv"])  # (text is the baseline every mode is paired with)


def test_graph_requests_carry_the_turn_lora_choice():
    """RunGraph's `base_turns` is the Graph's turn_lora, both ways."""
    from braid.runtime.convert import graph as from_request
    from braid.runtime.convert import graph_request

    for turn_lora in (True, False):
        g = task_graph(generate("vote", 1, 2), "calibrated", "mad-par")
        g.turn_lora = turn_lora
        request = graph_request(g)
        assert request.base_turns == (not turn_lora) and request.calibrated
        back = from_request(request, 64)
        assert back.turn_lora == turn_lora and back.calibrated and len(back.nodes) == len(g.nodes)
