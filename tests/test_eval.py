"""`braid eval` and its harness: every mode on the same branches, the hooks seam, and the reference model."""

import contextlib
import json
import os

import pytest

from braid.cli import main
from braid.engine import Engine, EngineConfig
from braid.evals.harness import (
    BASE_MODES,
    STAIRCASE_MODES,
    TEXT,
    EvalConfig,
    evaluate,
    hooked_modes,
    report,
    run_task,
    summarize,
)
from braid.methods.synthesis import SynthesisHooks
from braid.models import REFERENCE_MODEL
from braid.models.tasks import TASKS, generate

# Written by `braid eval --model models/braid-reference --tasks chain,vote,trail,multiqa --branches 2,7,12
# --samples 4 --length 2,12 --device cpu --dtype float32 --json <this file>`.
RECORDED = os.path.join(REFERENCE_MODEL, "eval_sample.json")


def test_hooks_plug_into_every_cached_mode(llama_engine):
    seen, entered = [], []

    def identity(kv, *, branch, num_branches, length=None):
        seen.append((branch, num_branches, tuple(kv.shape)))
        return kv

    @contextlib.contextmanager
    def adapter(rows=None):  # (rows: a forward that also holds the refresh runs' base-weight rows)
        entered.append(True)
        yield

    llama_engine.add_adapter("identity", adapter)
    hooked = hooked_modes("identity", SynthesisHooks(identity, "identity"))
    assert [m.name for m in hooked] == ["cache:none+identity", "cache:branch_point+identity",
                                        "cache:sequential+identity", "cache:sequential+refresh+identity",
                                        "cache:mixed+identity", "cache:mixed+refresh+identity"]
    task = generate("vote", 0, 3)
    config = EvalConfig(answer_max_tokens=4, worker_max_tokens=6)
    result = run_task(llama_engine, task, [*BASE_MODES, *hooked], config)
    for mode in hooked:  # an identity mapper changes nothing
        assert result.answers[mode.name] == result.answers[mode.name.rsplit("+", 1)[0]]
    # entered around every synthesizer forward of the six hooked modes: the header's and one per fed token
    assert sorted({(b, m) for b, m, _ in seen}) == [(0, 3), (1, 3), (2, 3)]
    assert 6 * 2 <= len(entered) <= 6 * (1 + config.answer_max_tokens)
    assert set(result.ttft) == {m.name for m in [*BASE_MODES, *hooked]}


def test_run_task_frees_everything(fresh_engine):
    before = fresh_engine.store.used_bytes
    run_task(fresh_engine, generate("multiqa", 1, 3), BASE_MODES, EvalConfig(answer_max_tokens=3))
    run_task(fresh_engine, generate("trail", 1, 2), BASE_MODES, EvalConfig(answer_max_tokens=3, worker_max_tokens=4))
    fresh_engine.clear_prefix_cache()  # (it keeps the task prompts, for the next request)
    assert fresh_engine.store.used_bytes == before


def test_summary_pairs_every_mode_with_text(llama_engine):
    config = EvalConfig(tasks=("chain",), branches=(2, 3), samples=3, answer_max_tokens=3, worker_max_tokens=4)
    results = evaluate(llama_engine, config, BASE_MODES, progress=False)
    rows = summarize(results, BASE_MODES)
    assert [(r["branches"], r["mode"]) for r in rows] == [(m, mode.name) for m in (2, 3) for mode in BASE_MODES]
    for r in rows:
        assert r["n"] == 3 and r["ci95"][0] <= r["accuracy"] <= r["ci95"][1] and r["ttft_ms_median"] > 0
        assert ("vs_text" in r) == (r["mode"] != TEXT.name)


def test_eval_cli_writes_json_and_refuses_bad_input(checkpoint, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", checkpoint("llama"), "--tasks", "vote", "--branches", "2", "--samples", "2",
                 "--device", "cpu", "--worker-max-tokens", "4", "--answer-max-tokens", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["summary"]] == [m.name for m in [*BASE_MODES, *STAIRCASE_MODES]]
    assert len(result["results"]) == 2 and "cache:sequential" in capsys.readouterr().out
    assert (tmp_path / "eval.png").stat().st_size > 0
    for bad, message in [(["--modes", "text,magic"], "unknown mode"), (["--branches", "1"], "branch counts"),
                         (["--tasks", "sum"], "tasks must be"), (["--length", "3"], "MIN,MAX"),
                         (["--hooks", "nohooks"], "name=package.module:factory")]:
        assert main(["eval", "--model", checkpoint("llama"), "--samples", "1", *bad]) == 2
        assert message in capsys.readouterr().err


def test_reference_model_loads_by_path_and_reaches_its_recorded_accuracy():
    """The committed checkpoint, through the path loader, answers a fixed sample exactly as recorded."""
    recorded = json.load(open(RECORDED))
    engine = Engine(EngineConfig(REFERENCE_MODEL, device="cpu", dtype="float32"))
    assert engine.fingerprint == recorded["fingerprint"]
    cfg = recorded["config"]
    config = EvalConfig(tasks=tuple(cfg["tasks"]), branches=tuple(cfg["branches"]), samples=cfg["samples"],
                        seed=cfg["seed"], length=tuple(cfg["length"]), worker_max_tokens=cfg["worker_max_tokens"],
                        answer_max_tokens=cfg["answer_max_tokens"])
    modes = [m for m in BASE_MODES if m.name in recorded["modes"]]
    got = report(config, REFERENCE_MODEL, engine.fingerprint, modes, evaluate(engine, config, modes, progress=False))
    accuracy = {(r["task"], r["branches"], r["mode"]): r["accuracy"] for r in got["summary"]}
    assert accuracy == {(r["task"], r["branches"], r["mode"]): r["accuracy"] for r in recorded["summary"]}
    # what the model has learned, over the wider range (work up to 12): every task answered from text at 2 and 7
    # branches, and at 12 in at least 3 of the 4 (MultiQA's twelve sums are its hardest answer)
    assert all(accuracy[(task, m, TEXT.name)] == 1.0 for task in TASKS for m in (2, 7))
    assert all(accuracy[(task, 12, TEXT.name)] >= 0.75 for task in TASKS)


def test_workflow_eval_reads_tot_and_debate_graphs_each_way_and_writes_json(checkpoint, tmp_path):
    """The reference tasks as ToT, MADiter and MADpar graphs (random weights here): every mode scored on the
    same tasks, paired against text; the final node reads the system prompt, then each last reply's worker
    turn (the parallel-synthesis layout); a debate turn reads the earlier replies, then its own notes."""
    from braid.evals import workflows
    from braid.models.tasks import generate

    task = generate("vote", 0, 3)
    graph = workflows.graph(task, "kv", "tot")
    assert [e.node for e in graph.node("final").parents] == ["system", "solution0", "solution1", "solution2"]
    waves = [([n.name for n in w], [n.name for n in a]) for w, a in graph.plan()]
    assert waves[-2:] == [(["solution0", "solution1", "solution2"], []), (["final"], [])]  # (the voter waits)
    stair = workflows.graph(task, "staircase", "tot").plan()
    assert [([n.name for n in w], [n.name for n in a]) for w, a in stair][-1] == (
        ["solution0", "solution1", "solution2"], ["final"])  # (it streams them)
    mad_iter = workflows.graph(task, "text", "mad-iter")
    assert [e.node for e in mad_iter.node("turn2").parents] == ["system", "turn0", "turn1", "turn2:notes"]
    assert mad_iter.node("turn1").output == "text" and [n.name for n in mad_iter.plan()[-1][0]] == ["final"]
    mad_par = workflows.graph(task, "staircase", "mad-par")
    assert [e.node for e in mad_par.node("round2:1").parents] == ["system", "round1:0", "round1:1", "round1:2",
                                                                  "round2:1:notes"]
    assert [([n.name for n in w], [n.name for n in a]) for w, a in mad_par.plan()][-1] == (
        ["round2:0", "round2:1", "round2:2"], ["final"])  # (the aggregator streams the second round)
    out = tmp_path / "w.json"
    workflows.main(["--model", checkpoint("llama"), "--workflows", "tot,mad-iter", "--tasks", "vote",
                    "--samples", "2", "--branches", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workflow"], r["mode"]) for r in rows] == [("tot", "text"), ("tot", "kv"), ("tot", "staircase"),
                                                          ("mad-iter", "text"), ("mad-iter", "kv")]
    assert all(r["n"] == 2 for r in rows) and all("minus_text" in r for r in rows if r["mode"] != "text")
    assert (tmp_path / "w.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        workflows.main(["--model", checkpoint("llama"), "--workflows", "debate", "--out", str(out)])


def test_refresh_probe_runs_each_refresh_both_ways_and_writes_json(tmp_path, capsys):
    """The reference model at 3 MultiQA branches: a whole-branch refresh in order is text re-prefill, so it
    answers as text does, task for task."""
    from braid.evals import refresh_probe

    out = tmp_path / "probe.json"
    assert refresh_probe.main(["--branches", "3", "--samples", "3", "--refresh", "1-1,99-0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["modes"] == ["text", "refresh 1-1 parallel", "refresh 1-1 in order", "refresh 99-0 parallel",
                               "refresh 99-0 in order"]
    for task in result["results"]:
        assert task["answers"]["refresh 99-0 in order"] == task["answers"]["text"]
    # (and in parallel it is not: the third branch read the second as shipped)
    assert any(t["answers"]["refresh 99-0 parallel"] != t["answers"]["text"] for t in result["results"])
    assert (tmp_path / "probe.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        refresh_probe.main(["--refresh", "3"])
    assert "HEAD-TAIL pairs" in capsys.readouterr().err
    assert refresh_probe.main(["--branches", "1"]) == 2 and "branch counts" in capsys.readouterr().err
