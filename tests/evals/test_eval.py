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


def test_an_eval_of_traces_records_what_ran_not_the_synthetic_defaults(checkpoint, tmp_path, capsys):
    """With --traces, the JSON's config lists the trace files, the held-out rule, how many workflows ran and at
    which branch counts, and the token caps; none of the synthetic tasks' settings, which did not run."""
    from braid.models.traces import SPLIT_RULE

    traces, out = tmp_path / "traces.jsonl", tmp_path / "eval.json"
    traces.write_text("".join(json.dumps({"task": "User: add.", "branches": [{"prompt": f"Part {i}.{j}"}
                                                                             for j in range(2 + i % 2)],
                                          "synthesis": {"prompt": "Synthesizer:"}}) + "\n" for i in range(8)))
    args = ["eval", "--model", checkpoint("llama"), "--calibration", "none", "--traces", str(traces), "--modes",
            "text,cache:sequential", "--worker-max-tokens", "2", "--answer-max-tokens", "2", "--json", str(out)]
    assert main([*args, "--held-out-traces", "2"]) == 0
    config = json.loads(out.read_text())["config"]
    assert config == {"traces": [str(traces)], "held_out": {"every": 2, "rule": SPLIT_RULE}, "workflows": 4,
                      "branches": [2, 3], "worker_max_tokens": 2, "answer_max_tokens": 2}  # (2 of each kind's 4)
    assert main([*args, "--held-out-traces", "0"]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["workflows"] == 8 and config["held_out"] == "none: every trace in the files"
    capsys.readouterr()
    assert main([*args, "--held-out-traces", "-1"]) == 2 and "--held-out-traces" in capsys.readouterr().err


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


# ---- the verified envelope: a paired bound per branch-count band ----------------------------------------------------
def test_the_exact_bounds_are_the_hand_computed_ones():
    import math

    from braid.evals.stats import binomial_upper_bound, paired_lower_bound, samples_needed

    # none seen in n: 1 - 0.05^(1/n); one in two: P(X <= 1) = 1 - p^2 = 0.05, so p = sqrt(0.95)
    assert binomial_upper_bound(0, 149) == pytest.approx(1 - 0.05 ** (1 / 149), abs=1e-15)
    assert binomial_upper_bound(1, 2) == pytest.approx(math.sqrt(0.95), abs=1e-12)
    assert binomial_upper_bound(5, 5) == 1.0
    # elsewhere: the rate at which k or fewer of n has probability 0.05
    p = binomial_upper_bound(3, 10)
    assert sum(math.comb(10, i) * p ** i * (1 - p) ** (10 - i) for i in range(4)) == pytest.approx(0.05, abs=1e-12)
    assert p == pytest.approx(0.6066, abs=1e-4)
    # the paired bound: minus that bound on the pairs the mode loses (text right, mode wrong); its wins make up
    # for nothing, and pairs that all agree do not collapse it to 0 as a bootstrap would
    assert paired_lower_bound([False, True], [True, True]) == -binomial_upper_bound(1, 2)
    assert paired_lower_bound([False, True], [True, False]) == -binomial_upper_bound(1, 2)
    assert paired_lower_bound([True] * 30, [True] * 30) == pytest.approx(-(1 - 0.05 ** (1 / 30)))
    assert paired_lower_bound([False] * 4, [False] * 4) == pytest.approx(-(1 - 0.05 ** (1 / 4)))
    # how many pairs a band needs: the fewest at which none lost passes
    for tolerance, need in [(0.02, 149), (0.05, 59), (0.1, 29), (0.01, 299)]:
        assert samples_needed(tolerance) == need
        assert binomial_upper_bound(0, need) <= tolerance < binomial_upper_bound(0, need - 1)
    with pytest.raises(ValueError):
        samples_needed(0.0)


def test_branch_counts_are_pooled_into_bands_by_sample_count_only():
    from braid.evals.harness import branch_bands

    thirty = {m: 30 for m in range(2, 13)}
    assert branch_bands(thirty, 149) == [(2, 3, 4, 5, 6), (7, 8, 9, 10, 11, 12)]  # (12's 30 join the band below)
    hundred = {m: 100 for m in range(2, 9)}
    assert branch_bands(hundred, 149) == [(2, 3), (4, 5), (6, 7, 8)]
    assert branch_bands({2: 200, 3: 5}, 149) == [(2, 3)]
    assert branch_bands({3: 10, 2: 10}, 149) == [(2, 3)]  # too few for any band: one, which cannot pass
    assert branch_bands({2: 149, 4: 149}, 149) == [(2,), (4,)]


def _pairs(task: str, m: int, n: int, lost: int = 0, won: int = 0):
    from braid.evals.harness import TaskResult

    return [TaskResult(task, i, m, "", True, correct={"text": i >= won, "calibrated": i >= lost if i >= won else True})
            for i in range(n)]


def test_verify_keeps_the_bands_from_the_fewest_branches_whose_paired_bound_holds():
    from braid.evals.harness import format_bands, verify

    # the case: about 30 traces a count, every answer agreeing: 2-12 in two bands of 150 and 180
    agree = [r for m in range(2, 13) for r in _pairs("traces", m, 30)]
    got = verify(agree)
    assert got["max_branches"] == 12 and got["needed_per_band"] == 149 and got["level"] == 0.95
    assert [b["branches"] for b in got["bands"]] == [[2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    first = got["bands"][0]
    assert first["n"] == 150 and first["mean_difference"] == 0 and first["passed"] and first["verifiable"]
    assert first["lower_bound"] == pytest.approx(-(1 - 0.05 ** (1 / 150)), abs=1e-6)
    assert got["bands"][1]["lower_bound"] == pytest.approx(-(1 - 0.05 ** (1 / 180)), abs=1e-6)
    # one text-right answer lost at 3 branches: 1 in 150 bounds the loss rate at 3.1 points: the first band fails,
    # and the envelope is contiguous from the fewest branches, so the second passing counts for nothing
    one = [r for m in range(2, 13) for r in _pairs("traces", m, 30, lost=int(m == 3))]
    got = verify(one)
    assert got["max_branches"] == 0 and [b["passed"] for b in got["bands"]] == [False, True]
    assert got["bands"][0]["tasks"]["traces"] == {"n": 150, "wins": 0, "losses": 1, "mean_difference": -0.006667,
                                                  "lower_bound": pytest.approx(-0.0312, abs=1e-4), "passed": False}
    assert got["passed"]["3"] is False and got["passed"]["12"] is True and got["gaps"]["traces/3"] == -0.0333
    # a wider tolerance needs fewer samples a band (59 at 5 points), so the bands are narrower: 1 lost in 60 bounds
    # the rate at 7.7 points
    wider = verify(one, tolerance=0.05)
    assert wider["needed_per_band"] == 59 and wider["max_branches"] == 0
    assert [b["branches"] for b in wider["bands"]] == [[2, 3], [4, 5], [6, 7], [8, 9], [10, 11, 12]]
    assert wider["bands"][0]["lower_bound"] == pytest.approx(-0.0766, abs=1e-4)
    # one lost at 9: the first band holds, the second (1 in 180: a 2.6-point bound) does not
    got = verify([r for m in range(2, 13) for r in _pairs("traces", m, 30, lost=int(m == 9))])
    assert got["max_branches"] == 6
    table = format_bands(got)
    assert "2-6" in table and "passed" in table and "failed" in table and "at least 149 samples" in table
    # too few traces for any band: not verifiable, whatever they say, and the output says how many it needs
    few = verify([r for m in (2, 3) for r in _pairs("traces", m, 10)])
    assert few["max_branches"] == 0 and few["bands"][0]["verifiable"] is False
    assert "not verifiable: too few samples (20; need 149)" in format_bands(few)


def test_verify_holds_every_task_to_the_bound_in_each_band():
    from braid.evals.harness import format_bands, verify

    # synthetic tasks at 100 a cell: bands 2-3, 4-5, 6-8 of 200, 200 and 300 per task
    results = [r for t in ("chain", "vote") for m in range(2, 9)
               for r in _pairs(t, m, 100, lost=2 if (t, m) == ("vote", 6) else 0, won=3 if t == "chain" else 0)]
    got = verify(results)
    assert [b["branches"] for b in got["bands"]] == [[2, 3], [4, 5], [6, 7, 8]]
    # 2 of 300 lost on vote bounds it at 2.1 points: that band fails on vote, though chain's there pass
    assert got["max_branches"] == 5 and got["tasks"] == ["chain", "vote"] and got["samples"] == 100
    last = got["bands"][2]
    assert last["tasks"]["chain"]["passed"] and not last["tasks"]["vote"]["passed"] and not last["passed"]
    assert last["tasks"]["chain"]["wins"] == 9 and last["tasks"]["chain"]["mean_difference"] == 0.03
    assert last["lower_bound"] == last["tasks"]["vote"]["lower_bound"] and "failed (on vote)" in format_bands(got)
    with pytest.raises(ValueError, match="vote/8"):
        verify([r for r in results if (r.task, r.branches) != ("vote", 8)])
    with pytest.raises(ValueError, match="calibrated"):
        verify(results, mode="calibrated+refresh")
