"""The training script: reproducible from its seed, and what it writes loads through the engine's path loader."""

import json
import random

import pytest
import torch
from transformers import AutoTokenizer

from braid.engine import Engine, EngineConfig, PrefillCall
from braid.models import REFERENCE_MODEL
from braid.models.chat import END, header, turn
from braid.train.prompt_tree import graph_loss
from braid.train.train import Batches, TrainConfig, batch, draw_task, load_for_training, lr_at, traces, train

TINY = dict(steps=3, tasks_per_step=3, row_tokens=512, max_length=2, hidden_size=32, num_layers=1, num_heads=2,
            num_kv_heads=1, intermediate_size=64, vocab_size=400, eval_every=2, device="cpu")


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
    more = train(TrainConfig(out=str(tmp_path / "b"), init_from=str(tmp_path / "a"),
                             **{**TINY, "steps": 2, "num_layers": 3}))  # shape flags yield to the checkpoint's
    assert more["total_steps"] == 5 and more["parameters"] == first["parameters"]
    assert more["config"]["num_layers"] == TINY["num_layers"]
    assert more["total_train_seconds"] > more["train_seconds"] > 0
    assert [r["loss"] for r in more["earlier_runs"]] == [first["loss"]]
    model, tokenizer, record = load_for_training(str(tmp_path / "a"))  # what the continued run starts from
    saved = Engine(EngineConfig(str(tmp_path / "a"), device="cpu", dtype="float32"))
    assert all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), saved.lm.model.state_dict().values()))
    assert tokenizer.get_vocab() == saved.tokenizer.get_vocab() and record["total_steps"] == 3
    assert Engine(EngineConfig(str(tmp_path / "b"), device="cpu")).tokenizer.get_vocab() == tokenizer.get_vocab()
    cfg = TrainConfig(**TINY)
    first_batch = batch(cfg, tokenizer, 0).ids
    assert torch.equal(first_batch, batch(cfg, tokenizer, 0).ids)  # a step's batch is its seed's and step's
    assert not torch.equal(first_batch, batch(cfg, tokenizer, 3).ids)  # a continuation (from step 3) draws new tasks


def test_a_time_limit_ends_the_run_evaluated_and_saved_with_the_schedule_at_its_floor(tmp_path):
    with pytest.raises(ValueError, match="time_limit"):
        TrainConfig(time_limit=-1)
    cfg = TrainConfig(**{**TINY, "steps": 1000, "eval_every": 1000, "warmup": 0}, time_limit=1e-9)
    assert lr_at(cfg, 1, 0.0) > lr_at(cfg, 1, 1.0) == pytest.approx(0.05 * cfg.lr)  # the clock's share counts
    assert lr_at(TrainConfig(**TINY, warmup=0), 1, 1e9) == lr_at(TrainConfig(**TINY, warmup=0), 1)  # none set
    done = train(TrainConfig(out=str(tmp_path / "a"), **{**TINY, "steps": 1000, "eval_every": 1000},
                             time_limit=1e-9))
    assert len(done["loss"]) == 1 and [e["step"] for e in done["held_out_accuracy"]] == [1]  # evaluated there
    assert json.loads((tmp_path / "a" / "training.json").read_text())["total_steps"] == 1  # and saved


def test_loader_processes_build_the_same_batches_in_the_same_order():
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL)  # any trained tokenizer; this one is committed
    cfg = TrainConfig(**TINY)
    inline = list(Batches(cfg, tokenizer, 5, 5))
    loaded = list(torch.utils.data.DataLoader(Batches(cfg, tokenizer, 5, 5), batch_size=None, num_workers=2))
    assert [b.tokens for b in loaded] == [b.tokens for b in inline] and all(b.tokens > 0 for b in inline)
    for a, b in zip(inline, loaded):
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("ids", "positions", "node", "pred", "weight"))


def test_config_chooses_the_tasks_and_worker_turns_trained():
    with pytest.raises(ValueError, match="tasks must name some of chain, vote"):
        TrainConfig(tasks="chain,chan")
    with pytest.raises(ValueError, match="worker_traces must be positive"):
        TrainConfig(worker_traces=0)
    with pytest.raises(ValueError, match="attention flex trains on CUDA only"):
        TrainConfig(attention="flex", device="cpu")
    cfg, rng = TrainConfig(tasks="vote", worker_traces=12), random.Random(0)
    for _ in range(5):
        task = draw_task(rng, cfg.max_length, cfg.task_names)
        assert task.name == "vote" and len(traces(task, rng, cfg.worker_traces)) == 1 + len(task.branches)
        assert len(traces(task, rng)) == 3  # the synthesizer's and two workers'


def test_lookup_drills_join_the_tasks_drawn():
    with pytest.raises(ValueError, match="lookup_drills must be >= 0"):
        TrainConfig(lookup_drills=-1)
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    plain, drilled = (tokenizer.decode(batch(TrainConfig(**TINY, tasks="vote", lookup_drills=n), tokenizer, 0).ids
                                       .flatten()) for n in (0, 1))
    assert "confidence" in plain and "records:" not in plain
    assert "confidence" in drilled and drilled.count("records:") >= 2


def test_graph_and_flat_packing_train_the_same_objective():
    """A task's traces as one graph encode fewer tokens, with the loss and gradients of the flat rows."""
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    model = AutoModelForCausalLM.from_pretrained(REFERENCE_MODEL, dtype=torch.float32)
    shared = dict(TINY, tasks_per_step=6, worker_traces=4, max_length=12)
    graph, flat = (batch(TrainConfig(**shared, packing=p), tokenizer, 0) for p in ("graph", "flat"))
    assert graph.tokens < flat.tokens == flat.flat_tokens == graph.flat_tokens
    # the written turns are leaves here (no shared node is supervised): the same targets, packed differently
    assert torch.equal(torch.sort(graph.labels).values, torch.sort(flat.labels).values)
    assert graph.weight.sum() == flat.weight.sum() == len(flat.labels)  # every written token counted once a trace
    results = []
    for packed in (graph, flat):
        model.zero_grad(set_to_none=True)
        loss = graph_loss(model, packed).loss
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    (loss_g, grads_g), (loss_f, grads_f) = results
    assert abs(loss_g - loss_f) < 1e-5
    for a, b in zip(grads_g, grads_f):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_parallel_graph_is_what_branch_point_synthesis_reads():
    """A MultiQA synthesizer trace as `parallel_graph` (branches encoded apart, each after the system prompt)
    predicts, teacher-forced, exactly the answer the engine decodes greedily from the branches' own KV under
    `cache:branch_point`, and not the text re-prefill's where the two differ: it trains what that mode serves."""
    from braid.evals.harness import TEXT, EvalConfig, Mode, run_task
    from braid.methods.synthesis import Placement, SynthesisMode
    from braid.models.tasks import generate, synthesizer_trace
    from braid.train.prompt_tree import pack
    from braid.train.train import encode, parallel_graph

    engine = Engine(EngineConfig(REFERENCE_MODEL, device="cpu", dtype="float32", calibration="none"))
    model, tok = engine.lm.model, AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    cached = Mode("cache:branch_point", SynthesisMode(Placement.BRANCH_POINT))
    differed = 0
    for m in (2, 3, 5, 7):
        task = generate("multiqa", m, m)
        result = run_task(engine, task, [TEXT, cached], EvalConfig(answer_max_tokens=64))
        texts = {name: a.removesuffix(END) for name, a in result.answers.items()}
        differed += texts["text"] != texts[cached.name]
        for name, want in texts.items():
            (pieces,) = encode(tok, [synthesizer_trace(task)[:-1] + [(want + END, True)]])
            packed = pack([parallel_graph(pieces)], 512, tok.pad_token_id)
            with torch.no_grad():
                correct = graph_loss(model, packed).correct
            assert bool(correct.all()) == (name == cached.name or texts["text"] == texts[cached.name]), (m, name)
    assert differed  # (the reference model answers these differently from cache and from text)


def test_parallel_traces_join_the_tasks_whose_branches_are_user_turns():
    with pytest.raises(ValueError, match="parallel must be a share"):
        TrainConfig(parallel=1.5)
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    from collections import Counter

    plain, parallel = (batch(TrainConfig(**TINY, tasks="multiqa", parallel=p), tokenizer, 0) for p in (0.0, 1.0))
    assert parallel.tokens > plain.tokens  # each task once more, with its branches apart
    # the same tasks (the draw for `parallel` has its own rng): every target of the plain batch is still there
    assert not Counter(plain.labels.tolist()) - Counter(parallel.labels.tolist())
    assert parallel.weight.sum() > plain.weight.sum()  # and its answer trained once more
    workers = (batch(TrainConfig(**TINY, tasks="vote", parallel=p), tokenizer, 0) for p in (0.0, 1.0))
    assert len({b.tokens for b in workers}) == 1  # worker tasks are never read apart: their replies saw contexts


def test_the_device_script_trains_and_packs_the_checkpoint_in_parts_that_load(tmp_path):
    """train/device_train.sh, as a lent GPU runs it (here on the CPU, without the install): the checkpoint comes
    back as tar parts under $OUT that reassemble into one the engine loads, with the run's log beside them."""
    import os
    import subprocess
    import sys
    import tarfile

    out, run = tmp_path / "out", tmp_path / "run"
    env = {**os.environ, "PY": sys.executable, "OUT": str(out), "RUN": str(run), "INSTALL": "0",
           "DEVICE_ARGS": "--device cpu"}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k != "device"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(["bash", os.path.join(root, "train", "device_train.sh"), *flags], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:]
    parts = sorted(out.glob("checkpoint.tar.*"))
    assert parts and "train rc=0" in (out / "train.log").read_text()
    (tmp_path / "whole.tar").write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(tmp_path / "whole.tar") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    assert json.loads((tmp_path / "back" / "training.json").read_text())["total_steps"] == TINY["steps"]
    assert Engine(EngineConfig(str(tmp_path / "back"), device="cpu")).tokenizer.get_vocab() == \
        AutoTokenizer.from_pretrained(str(run)).get_vocab()
