"""The CLI and the benchmark script run end to end on a tiny model (function, not timing)."""

import importlib.util
import json
import os

import pytest

from braid.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and all(cmd in out for cmd in ("demo", "serve", "run", "eval"))


def test_cli_rejects_bad_arguments(capsys, tmp_path):
    assert main(["demo", "--model", str(tmp_path / "missing")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--branches", "0"])


def test_demo_runs_a_task_in_every_mode(checkpoint, capsys):
    assert main(["demo", "--model", checkpoint("llama"), "--task", "trail", "--branches", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "task trail" in out and out.count("branch ") == 3 and "expected:" in out
    assert all(mode in out for mode in ("text", "cache:none", "cache:branch_point", "cache:sequential"))
    assert "calibrated" not in out  # (this model has no calibration)


def test_demo_shows_the_calibrated_mode_as_served(checkpoint, tmp_path, capsys):
    from braid.train.calibrate import write_untrained

    ckpt = checkpoint("llama")
    cal = write_untrained(ckpt, str(tmp_path / "cal"))  # (untrained: served with a token refreshed at each end)
    assert main(["demo", "--model", ckpt, "--calibration", cal, "--task", "vote", "--branches", "2"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert lines["calibrated+refresh"].endswith("(served)") and "(served)" not in lines["calibrated"]
    assert "calibrated-no-mapper" not in lines  # (the ablations are braid eval's)


def test_benchmark_writes_json_and_plot(checkpoint, tmp_path):
    spec = importlib.util.spec_from_file_location("synthesis_ttft", os.path.join(ROOT, "benchmarks",
                                                                                  "synthesis_ttft.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--checkpoint", checkpoint("llama"), "--device", "cpu", "--lengths", "16", "32", "--branches", "2",
                "--repeats", "1", "--decode-tokens", "4", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "synthesis_ttft_cpu.json").read_text())
    assert [r["branch_tokens"] for r in result["rows"]] == [16, 32]
    for row in result["rows"]:
        assert row["text_ttft_ms"] > 0 and row["cache_branch_point_ttft_ms"] > 0
        assert row["speedup_branch_point"] == pytest.approx(row["text_ttft_ms"] / row["cache_branch_point_ttft_ms"])
        assert row["calibration_overhead"] == pytest.approx(row["cache_calibrated_ttft_ms"]
                                                            / row["cache_branch_point_ttft_ms"] - 1)
        assert row["refresh_overhead"] == pytest.approx(row["cache_refresh_ttft_ms"] / row["cache_sequential_ttft_ms"]
                                                        - 1) and row["cache_served_ttft_ms"] > 0
    assert result["calibration"] == "random weights, trained shape"  # a random checkpoint has none of its own
    assert result["decode_tokens_per_s_batch1"] > 0
    assert (tmp_path / "synthesis_ttft_cpu.png").stat().st_size > 0


def test_cpu_threads_benchmark_runs_each_setting_in_its_own_processes(checkpoint, tmp_path):
    spec = importlib.util.spec_from_file_location("cpu_threads", os.path.join(ROOT, "benchmarks", "cpu_threads.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ckpt = checkpoint("llama")
    assert bench.main(["--checkpoint", ckpt, "--rounds", "1", "--calls", "1", "2", "--prefill", "8", "--steps", "3",
                       "--threads", "2", "--out", str(tmp_path)]) == 0
    stem = tmp_path / f"cpu_threads_{os.path.basename(os.path.normpath(ckpt))}"
    result = json.loads(stem.with_suffix(".json").read_text())
    assert [r["case"] for r in result["rows"]] == ["decode, 1 calls", "decode, 2 calls", "prefill, 8 tokens"]
    for row in result["rows"]:
        assert set(row["ms"]) == set(bench.SETTINGS) and all(v > 0 for v in row["ms"].values())
        assert row["one_thread_x"] == pytest.approx(row["ms"]["every core"] / row["ms"]["one thread"])
    assert stem.with_suffix(".png").stat().st_size > 0


def test_prompt_tree_benchmark_writes_json_and_plot(tmp_path):
    spec = importlib.util.spec_from_file_location("prompt_trees", os.path.join(ROOT, "benchmarks", "prompt_trees.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--shape", "tiny", "--device", "cpu", "--settings", "16:1:16,24:4:2", "--repeats", "1",
                "--out", str(tmp_path)])
    result = json.loads((tmp_path / "prompt_trees_cpu.json").read_text())
    assert [r["cached_token_ratio"] for r in result["rows"]] == [1.0, round(4 * 26 / 32, 2)]
    for row in result["rows"]:
        assert row["loss_gap"] < 1e-5  # both sides train the same objective
        assert row["speedup"] == pytest.approx(row["flat_step_s"] / row["packed_step_s"], rel=0.01)
    assert (tmp_path / "prompt_trees_cpu.png").stat().st_size > 0


def test_dag_staircase_benchmark_writes_json_and_plot(checkpoint, tmp_path):
    spec = importlib.util.spec_from_file_location("dag_staircase", os.path.join(ROOT, "benchmarks",
                                                                                "dag_staircase.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--checkpoint", checkpoint("llama"), "--device", "cpu", "--max-tokens", "4", "--repeats", "1",
                "--question-words", "6", "--workflows", "moa", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "dag_staircase_cpu.json").read_text())
    assert [(r["transport"], r["variant"]) for r in result["rows"]] == [
        ("kv", "reprefill"), ("kv", "append"), ("text", "reprefill"), ("text", "append")]
    for r in result["rows"]:
        assert r["ttft_reduction"] == pytest.approx(1 - r["staircase"]["final_ttft_ms"] / r["wait"]["final_ttft_ms"])
    assert (tmp_path / "dag_staircase_cpu.png").stat().st_size > 0


def test_decode_profile_times_static_decodes_beside_the_forwards_as_they_come(tmp_path):
    spec = importlib.util.spec_from_file_location("profile_decode", os.path.join(ROOT, "benchmarks",
                                                                                 "profile_decode.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--shape", "tiny", "--device", "cpu", "--context", "64", "--tokens", "4", "--rounds", "1",
                "--rows", "2", "--concurrency", "1", "3", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "profile_decode_cpu.json").read_text())
    assert result["graphs_speedup"] == pytest.approx(result["engine_ms_per_token"]
                                                     / result["engine_graphs_ms_per_token"])
    assert [r["calls"] for r in result["concurrency"]] == [1, 3]
    assert all(r["eager_tokens_per_s"] > 0 and r["graphs_tokens_per_s"] > 0 for r in result["concurrency"])
    assert result["graph_buckets"] > 0 and (tmp_path / "profile_decode_cpu.png").stat().st_size > 0


def test_workflow_benchmark_writes_json_and_plot(checkpoint, tmp_path):
    spec = importlib.util.spec_from_file_location("workflows", os.path.join(ROOT, "benchmarks", "workflows.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--checkpoint", checkpoint("llama"), "--device", "cpu", "--max-tokens", "3", "--repeats", "1",
                "--question-words", "6", "--turns", "--turn-solvers", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "workflows_cpu.json").read_text())
    assert [r["workflow"] for r in result["rows"]] == ["mad-iter", "tot", "mad-par"]
    for r in result["rows"]:
        assert r["ttft_ratio"] == pytest.approx(r["baseline"]["ttft_mean_ms"] / r["choreographed"]["ttft_mean_ms"])
        assert r["choreographed"]["decoding_nodes"] == {"mad-iter": 7, "tot": 12, "mad-par": 9}[r["workflow"]]
    # the turn LoRA's cost: the debates over notes, their turns timed (MADiter: 1 of 2 solvers; MADpar: round 2)
    assert [(r["workflow"], list(r["modes"])) for r in result["turn_lora"]] == [
        (w, ["kv", "calibrated, base turns", "calibrated, turn LoRA"]) for w in ("mad-iter", "mad-par")]
    for r in result["turn_lora"]:
        assert {m["decoding_nodes"] for m in r["modes"].values()} == {{"mad-iter": 1, "mad-par": 2}[r["workflow"]]}
        assert r["turn_ttft_ratio"] == pytest.approx(r["modes"]["calibrated, turn LoRA"]["ttft_mean_ms"]
                                                     / r["modes"]["calibrated, base turns"]["ttft_mean_ms"])
    assert (tmp_path / "workflows_cpu.png").stat().st_size > 0


@pytest.mark.parametrize("preset, transport, staircase", [
    ("tot", "grpc", ""), ("mad-iter", "text", ""), ("mad-par", "grpc", ""), ("moa", "grpc", ""),
    ("moa", "grpc", "reprefill"), ("mad-par", "text", "append"), ("tot", "grpc", "append")])
def test_run_presets_over_the_agent_api(checkpoint, capsys, preset, transport, staircase):
    from braid.cluster.inprocess import start_in_process
    from braid.engine import Engine, EngineConfig
    from braid.runtime.directory import Directory, EmbeddedRedis

    redis = EmbeddedRedis()
    server = start_in_process(Engine(EngineConfig(checkpoint("llama"))), Directory.connect(redis.url))
    try:
        assert main(["run", "--address", f"127.0.0.1:{server.port}", "--preset", preset, "--question", "2 or 3?",
                     "--max-tokens", "3", "--rounds", "2", "--agents", "3", "--voters", "2",
                     "--transport", transport, "--show-branches", *(["--staircase", staircase] if staircase else [])
                     ]) == 0
    finally:
        server.stop()
        redis.stop()
    out = capsys.readouterr().out
    assert out.count("[done] session") == (2 if preset == "tot" else 1)
    if preset == "tot":
        assert "[votes] solution" in out and "[final]" in out
    if preset == "mad-iter":
        assert "[round2:negative]" in out and "[moderator]" in out
    if preset == "moa":
        assert "[layer2:proposer2]" in out and "[aggregator]" in out
    reader = {"moa": "aggregator", "mad-par": "round2:agent0", "tot": "voter0"}.get(preset)
    assert (f"[{reader}] round 0 took in:" in out) == bool(staircase)  # (the rounds are shown with staircase only)
    assert main(["run", "--preset", "tot"]) == 2 and "or on a free-form --question" in capsys.readouterr().err
    assert main(["run", "--preset", "mad-iter", "--question", "q", "--staircase", "append"]) == 2
    assert "mad-iter has no staircase" in capsys.readouterr().err


def test_leakage_benchmark_control_never_lets_the_secret_through(tmp_path):
    spec = importlib.util.spec_from_file_location("leakage", os.path.join(ROOT, "benchmarks", "leakage.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--games", "3", "--out", str(tmp_path)])
    rows = {r["mode"]: r for r in json.loads((tmp_path / "leakage_cpu.json").read_text())["rows"]}
    # nothing Bob reads depends on Alice's secret under the control or the text baseline: his answer cannot move
    assert rows["control"]["answer_changes"]["rate"] == 0 and rows["text"]["answer_changes"]["rate"] == 0
    assert set(rows) == {"leak", "control", "text"} and (tmp_path / "leakage_cpu.png").stat().st_size > 0


def test_run_staircase_workflow_on_a_colocated_server_says_why_not(checkpoint, capsys):
    from braid.cluster.inprocess import start_in_process
    from braid.engine import Engine, EngineConfig
    from braid.runtime.directory import Directory, EmbeddedRedis

    redis = EmbeddedRedis()
    server = start_in_process(Engine(EngineConfig(checkpoint("llama"))), Directory.connect(redis.url))
    try:
        assert main(["run", "--address", f"127.0.0.1:{server.port}", "--raw", "--task", "t", "--branch", "a",
                     "--staircase", "reprefill"]) == 1
    finally:
        server.stop()
        redis.stop()
    err = capsys.readouterr().err
    assert "FAILED_PRECONDITION" in err and "this cluster is colocated" in err


def test_a_revision_checked_out_beside_this_tree_imports_its_own_braid(tmp_path):
    """benchmarks.revision: under each side's PYTHONPATH, `import braid` is that side's checkout (what step_host.py
    and cpu_threads.py --against measure), and the checkout is gone afterwards."""
    import subprocess
    import sys

    sys.path.append(ROOT)
    from benchmarks.revision import labels, sides

    if not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout: there is no revision to check out beside it")
    head, rev = labels("HEAD")
    assert head.removesuffix("+changes") == rev
    with sides("HEAD", str(tmp_path)) as paths:
        assert list(paths) == ["this tree", rev]
        found = {name: subprocess.run([sys.executable, "-c", "import braid.engine.threads as m, os; "
                                       "print(os.path.realpath(m.__file__))"],
                                      env=dict(os.environ, PYTHONPATH=path), check=True, capture_output=True,
                                      text=True, cwd=tmp_path).stdout.strip()  # (not ROOT: `-c` puts the cwd first)
                 for name, path in paths.items()}
    assert found["this tree"] == os.path.join(os.path.realpath(ROOT), "engine", "threads.py")
    assert found[rev] == os.path.join(os.path.realpath(tmp_path), "tree", "engine", "threads.py")
    assert not (tmp_path / "tree").exists()


def test_kvcomm_benchmark_times_both_methods_for_every_agent(checkpoint, tmp_path):
    spec = importlib.util.spec_from_file_location("kvcomm_bench", os.path.join(ROOT, "benchmarks", "kvcomm_ttft.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--checkpoint", checkpoint("llama"), "--device", "cpu", "--agents", "2", "--input-tokens", "12",
                       "--prefix-tokens", "6", "--anchors", "2", "--requests", "1", "--recompute", "0,0.5",
                       "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "kvcomm_cpu.json").read_text())
    # (agent 1 prefills the text: its prompt is the base the other agent reuses)
    assert [r["agent"] for r in result["rows"]] == [1, 2] and result["measured_reuse_rate"] == 0.5
    for row in result["rows"]:
        assert row["dense_ttft_s"] > 0 and set(row["by_recompute"]) == {"0.0", "0.5"}
        assert row["speedup"] == pytest.approx(row["dense_ttft_s"] / row["kvcomm_ttft_s"])


BEFORE_SCHEDULER = "9959479"  # the engine before the scheduler: one call at a time behind its lock


def test_serving_benchmark_runs_a_revision_s_engine_beside_this_tree_s(checkpoint, tmp_path):
    """benchmarks/serving.py --against: a third server runs that revision's own engine (the one before the scheduler,
    which has no forward counters), driven by the same load as the others; the JSON has its rows and the scheduler's
    ratios against it."""
    import subprocess

    if subprocess.run(["git", "-C", ROOT, "cat-file", "-e", BEFORE_SCHEDULER + "^{commit}"],
                      capture_output=True).returncode:
        pytest.skip(f"no git history holding {BEFORE_SCHEDULER} to check out beside this tree")
    spec = importlib.util.spec_from_file_location("serving_bench", os.path.join(ROOT, "benchmarks", "serving.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--model", checkpoint("llama"), "--concurrency", "2", "--requests-per-level", "1",
                       "--worker-max-tokens", "4", "--answer-max-tokens", "4", "--transports", "text",
                       "--against", BEFORE_SCHEDULER, "--out", str(tmp_path)]) == 0
    with open(tmp_path / "serving_cpu_against.json") as f:
        result = json.load(f)
    assert result["against"] == BEFORE_SCHEDULER
    rows = {r["engine"]: r for r in result["rows"]}
    assert sorted(rows) == ["before", "scheduler", "serial"]
    assert all(r["completed"] == 8 and r["failed"] == 0 for r in rows.values())
    # that revision's engine served (it counts no forwards); this tree's engines did
    assert "calls_per_forward" not in rows["before"] and rows["before"]["revision"] == BEFORE_SCHEDULER
    assert rows["scheduler"]["calls_per_forward"] >= 1 and rows["serial"]["calls_per_forward"] == 1
    (ratio,) = result["ratios"]
    assert ratio["against"] == bench.compare(rows["scheduler"], rows["before"])
    assert ratio["token_throughput_x"] == bench.compare(rows["scheduler"], rows["serial"])["token_throughput_x"]
    assert (tmp_path / "serving_cpu_against.png").exists()


def test_device_run_dry_run_takes_every_step(tmp_path):
    """benchmarks/device_run.sh, the script a lent GPU's few minutes go to, as its dry run (SHAPE=tiny DEVICE=cpu):
    the install (as pip's --dry-run, so this environment stays as it is), every benchmark and both test steps
    (the engine tests cut to one file) exit 0 and the benchmarks leave their JSON, so a GPU run never meets a
    broken step."""
    import re
    import subprocess
    import sys

    script = os.path.join(ROOT, "benchmarks", "device_run.sh")
    env = {**os.environ, "SHAPE": "tiny", "DEVICE": "cpu", "OUT": str(tmp_path), "PY": sys.executable,
           "PIP_DRY_RUN": "1", "TESTS": "tests/kernels/test_rope.py", "BASELINE": str(tmp_path / "baseline-tree"),
           "BUDGET": "1500"}
    for name in ("STEPS", "LENGTHS", "REPEATS", "GROUPS_", "LAYERS", "DECODE_ARGS", "KV_ARGS", "CAL_ARGS", "SERVE_ARGS",
                 "BASE_ARGS", "KV_GIB", "GRAPH_TESTS", "DRIFT_ARGS"):
        env.pop(name, None)  # (the script's own defaults)
    # the engine to compare against, as the device run carries it (here this commit's, where there is git history)
    baseline = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "device_baseline.sh"), "HEAD",
                               env["BASELINE"]], cwd=ROOT, capture_output=True, text=True).returncode == 0
    done = subprocess.run(["bash", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    with open(script) as f:
        steps = re.search(r"STEPS=\$\{STEPS:-([^}]*)\}", f.read()).group(1).split()
    returned = dict(re.findall(r"^== \S+ (\w+) rc=(\d+)$", log, re.MULTILINE))
    expected = ["install", "checkpoint", *steps] if baseline else \
        ["install", "checkpoint", *(s for s in steps if s != "baseline_decode")]
    assert returned == {name: "0" for name in expected}, log[-4000:]
    if baseline:  # (timed by its own script, beside this tree's)
        assert (tmp_path / "baseline" / "profile_decode_cpu.json").exists()
    for name in ("profile_decode", "serving", "synthesis_ttft", "kvcomm", "batched_forward", "calibration_cost_tiny",
                 "kv_drift"):
        assert (tmp_path / f"{name}_cpu.json").exists(), name
    drift = json.loads((tmp_path / "kv_drift_cpu.json").read_text())  # (fp32 on CPU: the same up to rounding)
    assert drift["max_abs_diff"] < 1e-3 and drift["greedy_after_agree"] == drift["answers"]
    with open(tmp_path / "profile_decode_cpu.json") as f:  # (attention flex, and overlap, timed beside the default)
        decode = json.load(f)
    assert decode["flex"]["flex_ms_per_token"] > 0 and decode["overlap"]["on_ms_per_token"] > 0
    assert decode["paged"]["paged_ms_per_token"] > 0
    with open(tmp_path / "profile_decode_compile_cpu.json") as f:  # (compiled forwards: a step of their own)
        compiled = json.load(f)["compile"]
    assert compiled["on_ms_per_token"] > 0 and compiled["on_prefill_ms"] > 0 and compiled["compiled_forwards"] > 0
    engine_tests = log.split(" engine_tests\n", 1)[1].split(" engine_tests rc=", 1)[0]
    assert "[100%]" in engine_tests, engine_tests  # (they ran: pytest's rc 0 means collected and passed)
    assert log.rstrip().endswith("done") and (tmp_path / "device.log").exists()
    # past the call's budget, the steps left are skipped and said so
    spent = subprocess.run(["bash", script], cwd=ROOT, env={**env, "BUDGET": "5", "STEPS": "profile_decode",
                                                            "OUT": str(tmp_path / "spent")},
                           capture_output=True, text=True, timeout=300)
    assert "profile_decode skipped:" in spent.stdout and "profile_decode rc=" not in spent.stdout, spent.stdout


def test_ab_benchmark_runs_each_side_s_own_script_in_turns(tmp_path):
    """benchmarks/ab.py: each repeat runs the benchmark under this tree and under the other revision (here HEAD,
    checked out beside it), and the JSON holds every run's figures and the medians compared."""
    import subprocess

    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("no git history to check out beside this tree")
    spec = importlib.util.spec_from_file_location("ab_bench", os.path.join(ROOT, "benchmarks", "ab.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--against", "HEAD", "--repeats", "1", "--out", str(tmp_path), "synthesis_ttft", "--",
                       "--shape", "tiny", "--lengths", "16", "--repeats", "1", "--decode-tokens", "0"]) == 0
    with open(tmp_path / "ab_synthesis_ttft.json") as f:
        result = json.load(f)
    assert set(result["runs"]) == {"this", "against"} and result["against"] == result["this"].split("+")[0]
    assert all(len(runs) == 1 for runs in result["runs"].values())
    assert {"text@16", "cache_served@16"} <= set(result["compared"])
    for figure in result["compared"].values():
        assert figure["this_median"] > 0 and figure["against_median"] > 0 and not figure["higher_is_better"]
    assert (tmp_path / "ab_synthesis_ttft.png").exists()
