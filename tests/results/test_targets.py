"""The quantitative targets named by ended issues, checked on the committed results that back them.

Each test reads a committed JSON (benchmarks/results/*.json, or the reference model's training.json and its
calibration manifest) and asserts the target as the issue words it. Where the committed result misses the
target, the case is a strict xfail whose reason gives the measured figure and the target: a later file that
meets the target makes it pass, and strict xfail then fails the suite until the mark is removed.

How the files are read:
- Figures are computed from the file's raw fields (TTFTs, throughputs, per-task correctness, the repeats of an
  A/B run), never from a "passed" flag or a "verdict" string.
- "Within X points of text (or dense)" is read as the paired mean difference (the mode minus the baseline over
  the same tasks) being at least -X. The issues ask for the paired 95% CI to be reported beside it; where it is
  in the file, the docstrings quote it. A CI is not required to lie inside the band (no issue says so).
- Several quality results were measured on the reference model's previous checkpoint (fingerprint cb233efb...,
  before issue 12's parallel fine-tune): eval_reference*, eval_kvcomm*. They are checked as committed.
- Every file a target reads must stand as measured under the stamp contract (`braid.results.unclean`: its stamp
  written by the run, at a named commit, on a tree without uncommitted changes, and saying the same tree as the
  file's own record where that names one). `result` fails a target read from a file that does not, naming the
  file and why. The files that did not when the stamps were first read (written before the contract, their
  stamps backfilled, or measured on a dirty tree) are listed in KNOWN_UNCLEAN: a target read from one is an xfail
  whose reason is the file's stamp, so its figure is not checked until the file is measured again on a clean
  tree; a listed file that is clean fails until it is taken off the list, a file not listed that is unclean fails.
- The calibration manifest's verification (issue 12's target) is held to the same rule: it carries no stamp (its
  `identity` says it was recorded afterwards, by commit d7f4f39).

Named targets with no committed result (no test):
- issue 11: the prompt-tree step benchmark on a GPU ("speedup of at least 0.8x the cached-token ratio", on a GPU
  when one is lent): there is no prompt_trees_cuda.json.
- issue 16: "sessions with 3 Synthesizer replicas: every session call succeeds": covered by tests, no results
  file.
- issue 3: "fits on CPU in about 90 minutes": the committed model was trained on GPUs; no results file records
  the default CPU recipe (and "about" gives no bound).
- issue 15: "throughput at concurrency 64" on a GPU is named without a number (profile_decode_cuda.json has the
  figures, 523-533 tok/s on an H200); issue 4's NCCL throughput likewise.
- issue 11: "attention stays a small share of the cost" has no number (prompt_trees_cpu.json: 46-53%).
Figures an issue names as the paper's, not as targets: issue 16's TTFT ratios 2.0/3.5/6.2x for MADiter, ToT and
MADpar (workflows_cpu.json: 5.0/4.1/4.1x); issue 12's ablation -17/-8/-12; issue 14's 70% reuse.
"""

import functools
import json
import re
import statistics
from pathlib import Path

import pytest

from braid.results import unclean

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
EPS = 1e-9  # float representation only (0.98 - 1.0 is -0.0200...02): no tolerance beyond the issue's own
TASKS = ["chain", "vote", "trail", "multiqa"]


MANIFEST = "models/braid-reference/calibration/calibration.json"
# The files targets read that did not stand as measured (`braid.results.unclean`) when the stamps were first read
# (every one then). Each is taken off once it is measured again on a clean tree (`clean` fails until it is). (Names
# unquoted: test_known_unclean_lists_only_files_a_target_reads finds the quoted ones the tests read.)
KNOWN_UNCLEAN = set("""
    ab_serving_c16.json ab_synthesis_ttft_100m_7x.json eval_kvcomm_a8q5_cpu.json eval_kvcomm_cpu.json
    eval_kvcomm_recompute_cpu.json eval_mixed_calibrated_long_cpu.json eval_mixed_calibrated_m4_cpu.json
    eval_mixed_uncalibrated_vs_calibrated_m8_cpu.json eval_reference_cpu.json eval_reference_wide_cpu.json
    eval_verify_mixed_cpu.json kvcomm_cuda.json multinode_cpu.json profile_decode_cuda.json
    prompt_tree_training_cpu.json prompt_trees_cpu.json serving_cpu_against_aio.json
    serving_cpu_against_aio_16.json serving_cpu_against_aio_16b.json serving_cpu_against_aio_16c.json
    soak_cpu.json synthesis_ttft_cuda.json models/braid-reference/calibration/calibration.json
""".split())


@functools.cache
def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def clean(name: str, data: dict) -> dict:
    """`data`, read from file `name`, where it stands as measured under the stamp contract. Otherwise the target
    fails naming the file and why, or, for a file in KNOWN_UNCLEAN, is an xfail saying so."""
    why = unclean(data)
    if why is None:
        assert name not in KNOWN_UNCLEAN, f"{name} stands as measured now: take it off KNOWN_UNCLEAN"
        return data
    if name in KNOWN_UNCLEAN:
        pytest.xfail(f"{name}: {why}")
    pytest.fail(f"target read from {name}, which does not stand as measured: {why}")


def result(name: str) -> dict:
    """benchmarks/results/<name>, where it stands as measured (`clean`)."""
    return clean(name, _load(RESULTS / name))


def case(*values, miss: str | None = None, id: str | None = None):
    """A parametrized case; `miss` (the committed result misses the target) makes it a strict xfail."""
    marks = () if miss is None else (pytest.mark.xfail(strict=True, reason=miss),)
    return pytest.param(*values, marks=marks, id=id)


def _rows(data: dict, task: str, branches: int | None) -> list[dict]:
    rows = [r for r in data["results"] if r["task"] == task and (branches is None or r["branches"] == branches)]
    assert rows, f"no results for {task} at {branches} branches"
    return rows


def accuracy(data: dict, mode: str, task: str, branches: int | None = None) -> float:
    """The share of tasks `mode` answered right, from the per-task results (all branch counts when None)."""
    rows = _rows(data, task, branches)
    return sum(bool(r["correct"][mode]) for r in rows) / len(rows)


def paired_gap(data: dict, mode: str, task: str, branches: int, base: str = "text") -> tuple[float, int]:
    """Accuracy of `mode` minus that of `base` over the same tasks, and the number of tasks."""
    rows = _rows(data, task, branches)
    return sum(bool(r["correct"][mode]) - bool(r["correct"][base]) for r in rows) / len(rows), len(rows)


def ab_medians(data: dict, figure: str) -> tuple[float, float, int]:
    """An interleaved A/B run: the median over repeats of this side and of the revision against, and the fewest
    repeats either side ran. Runs are keyed by each side's commit or by "this"/"against"."""
    runs = data["runs"]
    this = runs[data["this"]] if data["this"] in runs else runs["this"]
    against = runs[data["against"]] if data["against"] in runs else runs["against"]
    return (statistics.median(r[figure] for r in this), statistics.median(r[figure] for r in against),
            min(len(this), len(against)))


# --- issues 2 and 15: the 8B shape on a GPU ----------------------------------------------------------------------

@pytest.mark.parametrize("branch_tokens, target", [
    case(512, 5.0, id="512", miss="issues 2/15: measured 4.36x (text 117.6 ms, cache 27.0 ms), target 5x"),
    case(1024, 9.0, id="1024", miss="issues 2/15: measured 7.63x (text 355.6 ms, cache 46.6 ms), target 9x"),
    case(2048, 14.0, id="2048"),
    case(4096, 20.0, id="4096"),
])
def test_8b_synthesis_ttft_speedup_over_text(branch_tokens, target):
    """Issues 2 and 15: synthesis TTFT, text re-prefill against the cache path, m = 4, Llama-3.1-8B shape, bf16:
    "at least 5, 9, 14 and 20x" at 512, 1024, 2048 and 4096 tokens per branch (synthesis_ttft_cuda.json; the
    cache path at the paper's branch-point placement)."""
    data = result("synthesis_ttft_cuda.json")
    assert "llama-3.1-8b" in data["shape"] and data["dtype"] == "bfloat16"
    row = next(r for r in data["rows"] if r["branch_tokens"] == branch_tokens)
    assert row["branches"] == 4
    assert row["text_ttft_ms"] / row["cache_branch_point_ttft_ms"] >= target


@pytest.mark.xfail(strict=True, reason="issues 2/15: measured 91.9 tok/s (CUDA graphs, H200), target 150 tok/s")
def test_8b_batch1_decode_rate():
    """Issues 2 and 15: "on GPU, batch-1 decode of the 8B shape at 150 tokens/s or more"
    (profile_decode_cuda.json, the full 32 layers, the faster of the eager and CUDA-graph paths)."""
    data = result("profile_decode_cuda.json")
    assert data["shape"] == "llama-3.1-8b" and data["layers"] == 32
    one = next(c for c in data["concurrency"] if c["calls"] == 1)
    assert max(one["eager_tokens_per_s"], one["graphs_tokens_per_s"]) >= 150


# --- issue 3: the reference model learned its tasks --------------------------------------------------------------

@pytest.mark.parametrize("name", ["eval_reference_cpu.json", "eval_verify_mixed_cpu.json"])
@pytest.mark.parametrize("task", TASKS)
def test_text_reprefill_at_4_branches(name, task):
    """Issue 3: "text re-prefill accuracy is at least 95% on every task at 4 branches". eval_reference_cpu.json is
    the issue's own table (previous checkpoint, n = 30; trail 96.7%); eval_verify_mixed_cpu.json is the current
    model (n = 100)."""
    assert accuracy(result(name), "text", task, branches=4) >= 0.95 - EPS


# --- issue 11: prompt trees ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("ratio", [1, 4, 16, 64])
def test_prompt_tree_step_speedup(ratio):
    """Issue 11: packed vs flat training step at cached-token ratios of about 1, 4, 16 and 64: "a speedup of at
    least 0.8x the cached-token ratio" (prompt_trees_cpu.json, CPU)."""
    rows = result("prompt_trees_cpu.json")["rows"]
    row = min(rows, key=lambda r: abs(r["cached_token_ratio"] / ratio - 1))
    assert 0.5 * ratio <= row["cached_token_ratio"] <= 2 * ratio, f"no row near a ratio of {ratio}"
    assert row["flat_step_s"] / row["packed_step_s"] >= 0.8 * row["cached_token_ratio"]


def test_prompt_tree_packed_loss_equals_flat():
    """Issue 11: exactness, "the packed loss equals the flat loss ... within 1e-5 (fp32)": the loss gap of every
    benchmark row (prompt_trees_cpu.json), and of the reference trainer's first step run both ways from one seed
    (prompt_tree_training_cpu.json)."""
    for row in result("prompt_trees_cpu.json")["rows"]:
        assert abs(row["loss_gap"]) <= 1e-5, row
    assert abs(result("prompt_tree_training_cpu.json")["first_step_loss_gap"]) <= 1e-5


def test_prompt_tree_trainer_step_time_ratio():
    """Issue 11: the reference trainer run both ways from one seed, wall time ratio reported; held to the issue's
    bar for packing, "a speedup of at least 0.8x the cached-token ratio" (prompt_tree_training_cpu.json: flat over
    graph step time 1.00x at a cached-token ratio of 1.13)."""
    runs = result("prompt_tree_training_cpu.json")["runs"]
    graph, flat = runs["graph"], runs["flat"]
    assert flat["step_seconds"] / graph["step_seconds"] >= 0.8 * graph["flat_tokens_seen"] / graph["tokens_seen"]


@pytest.mark.parametrize("task", TASKS)
def test_text_reprefill_wider_range_per_task(task):
    """Issue 11: after the retrain, "text re-prefill at 95% or more on every task across the wider range (2-12
    branches, the longer branch work)" (eval_reference_wide_cpu.json, previous checkpoint, 330 tasks per task:
    chain 99.7%, vote 99.7%, trail 100%, MultiQA 98.2%)."""
    assert accuracy(result("eval_reference_wide_cpu.json"), "text", task) >= 0.95 - EPS


@pytest.mark.parametrize("task, branches", [
    case(task, branches, id=f"{task}-{branches}", miss={
        ("multiqa", 11): "issue 11: measured MultiQA at 11 branches 93.3% (n = 30), target 95% in every cell",
        ("multiqa", 12): "issue 11: measured MultiQA at 12 branches 90.0% (n = 30), target 95% in every cell",
    }.get((task, branches)))
    for task in TASKS for branches in range(2, 13)])
def test_text_reprefill_wider_range_per_cell(task, branches):
    """Issue 11: the same bar, "95% or more on every task across the wider range", read per branch count
    (eval_reference_wide_cpu.json, n = 30 per cell, work 2-12). The closing note states the cell-level misses."""
    assert accuracy(result("eval_reference_wide_cpu.json"), "text", task, branches) >= 0.95 - EPS


# --- issue 12: trained calibration --------------------------------------------------------------------------------

@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("branches", range(2, 9))
def test_calibration_manifest_verification(task, branches):
    """Issue 12: "the full method within 2 points of text re-prefill, or better, on every task ... the same at 2-8
    branches", on seeds disjoint from training: the committed calibration manifest's verification gaps (the served
    mode minus text, n = 100 per cell, seeds from 5000)."""
    verification = clean(MANIFEST, _load(ROOT / MANIFEST)["verification"])
    assert verification["gaps"][f"{task}/{branches}"] >= -0.02 - EPS


_CALIBRATED = [case("eval_verify_mixed_cpu.json", task, b, id=f"verify-{task}-{b}")
               for task in TASKS for b in range(2, 9)]
_CALIBRATED += [case("eval_mixed_calibrated_m4_cpu.json", task, 4, id=f"m4-{task}") for task in TASKS]
_CALIBRATED += [case("eval_mixed_uncalibrated_vs_calibrated_m8_cpu.json", task, 8, id=f"m8-{task}") for task in TASKS]
_CALIBRATED += [case("eval_mixed_calibrated_long_cpu.json", task, 4, id=f"long-{task}", miss=(
    "issue 12: measured vote -3.3 points (96.7% vs 100%, n = 30, work 9-12), target within 2 points"
    if task == "vote" else None)) for task in TASKS]


@pytest.mark.parametrize("name, task, branches", _CALIBRATED)
def test_calibrated_answers_match_text(name, task, branches):
    """Issue 12: the served calibrated mode (calibrated+refresh) "within 2 points of text re-prefill, or better, on
    every task" at 4 branches, at 2-8 branches, on branch lengths never trained on, and on seeds disjoint from
    training; computed from the paired per-task results: eval_verify_mixed_cpu.json (2-8 branches, n = 100, seeds
    5000-5099; each miss -1 point, CI [-3, 0]), eval_mixed_calibrated_m4_cpu.json (4 branches, n = 30),
    eval_mixed_uncalibrated_vs_calibrated_m8_cpu.json (8 branches, n = 50), eval_mixed_calibrated_long_cpu.json
    (4 branches of work 9-12, n = 30)."""
    gap, _ = paired_gap(result(name), "calibrated+refresh", task, branches)
    assert gap >= -0.02 - EPS


_TTFT_OVERHEAD = [case("synthesis_ttft_cpu.json", n, id=f"cpu-{n}") for n in (128, 256, 512, 1024)] + [
    case("synthesis_ttft_cuda.json", 512, id="cuda-512",
         miss="issue 12: measured +11.3% (30.1 vs 27.0 ms, H200, 8B shape), target at most 10% slower"),
    case("synthesis_ttft_cuda.json", 1024, id="cuda-1024"),
    case("synthesis_ttft_cuda.json", 2048, id="cuda-2048",
         miss="issue 12: measured +16.4% (37.4 vs 32.1 ms, H200, 8B shape), target at most 10% slower"),
    case("synthesis_ttft_cuda.json", 4096, id="cuda-4096",
         miss="issue 12: measured +20.6% (46.9 vs 38.9 ms, H200, 8B shape), target at most 10% slower"),
]


@pytest.mark.parametrize("name, branch_tokens", _TTFT_OVERHEAD)
def test_calibration_ttft_overhead(name, branch_tokens):
    """Issue 12: "the serving cost of mapper and LoRA: cache-path TTFT with calibration against without, side by
    side in benchmarks/synthesis_ttft.py. Target: at most 10% slower" (the calibrated cache path against the
    uncalibrated one at the same branch-point placement)."""
    row = next(r for r in result(name)["rows"] if r["branch_tokens"] == branch_tokens)
    assert row["cache_calibrated_ttft_ms"] <= 1.10 * row["cache_branch_point_ttft_ms"]


@pytest.mark.parametrize("name, branch_tokens", [pytest.param(*p.values, id=p.id) for p in _TTFT_OVERHEAD])
def test_calibrated_cache_path_keeps_its_speedup_over_text(name, branch_tokens):
    """Issue 12: "... at most 10% slower, with the speedups over text kept": the calibrated cache path still
    reaches its first token before text re-prefill (CPU 6.6-34.9x, H200 3.9-20.7x)."""
    row = next(r for r in result(name)["rows"] if r["branch_tokens"] == branch_tokens)
    assert row["cache_calibrated_ttft_ms"] < row["text_ttft_ms"]


# --- issue 13: staircase streaming --------------------------------------------------------------------------------

_SLOW_R0 = "issue 13: measured {:.1%} lower (one slow worker, 1 s late, redundancy 0), target at least 95% lower"
_STAIRCASE = [case(method, transport, False, 0, id=f"{method}-{transport}")
              for method in ("reprefill", "append") for transport in ("text", "kv")]
_STAIRCASE += [case(method, "kv", True, 1, id=f"{method}-kv-slow-r1") for method in ("reprefill", "append")]
_STAIRCASE += [case(method, transport, True, 0, id=f"{method}-{transport}-slow-r0", miss=_SLOW_R0.format(v))
               for (method, transport), v in {("reprefill", "text"): 0.870, ("reprefill", "kv"): 0.879,
                                              ("append", "text"): 0.875, ("append", "kv"): 0.876}.items()]


@pytest.mark.parametrize("method, transport, slow, redundancy", _STAIRCASE)
def test_staircase_ttft_below_waiting(method, transport, slow, redundancy):
    """Issue 13: staircase against wait-for-all, 4 branches of 64-512 tokens, one slow worker and none: "TTFT at
    least 95% below wait-for-all at the longest setting" (staircase_cpu.json, 512 tokens, first chunk 8; each
    variant and transport against waiting on the same transport and the same slow worker)."""
    rows = result("staircase_cpu.json")["rows"]
    row = next(r for r in rows if r["length"] == 512 and r["method"] == method and r["transport"] == transport
               and r["slow"] == slow and r["redundancy"] == redundancy and r["first_chunk"] == 8)
    waiting = next(r for r in rows if r["length"] == 512 and r["method"] == "wait-for-all"
                   and r["transport"] == transport and r["slow"] == slow)
    assert row["ttft_s"] <= 0.05 * waiting["ttft_s"]


# --- issue 14: KVComm ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, recompute", [
    case("kvcomm_cpu.json", "0.0", id="cpu-r0"),
    case("kvcomm_cpu.json", "0.2", id="cpu-r0.2",
         miss="issue 14: measured 2.52x at agent 5 with the default recompute 0.2 (100M CPU proxy), target 8x"),
    case("kvcomm_cuda.json", "0.0", id="cuda-r0",
         miss="issue 14: measured 0.95x at agent 5 (the seed's workload, 8B shape, H200), target 8x"),
    case("kvcomm_cuda.json", "0.2", id="cuda-r0.2",
         miss="issue 14: measured 0.49x at agent 5 (the seed's workload, 8B shape, H200), target 8x"),
])
def test_kvcomm_ttft_at_agent_5(name, recompute):
    """Issue 14: KVComm against dense prefill side by side, 1K input and 512-token prefixes: "at least 8x lower
    TTFT at agent 5, the seed's workload or its CPU proxy". Recompute 0 is the seed's method; 0.2 is Braid's
    default (kvcomm_recompute)."""
    agent5 = next(r for r in result(name)["rows"] if r["agent"] == 5)
    assert agent5["dense_ttft_s"] / agent5["by_recompute"][recompute]["kvcomm_ttft_s"] >= 8


@pytest.mark.parametrize("name, recompute", [
    case("eval_kvcomm_cpu.json", 0.0, id="reference-r0"),
    case("eval_kvcomm_recompute_cpu.json", 0.1, id="reference-r0.1"),
    case("eval_kvcomm_recompute_cpu.json", 0.2, id="reference-r0.2"),
    case("eval_kvcomm_a8q5_cpu.json", 0.0, id="a8q5-r0",
         miss="issue 14: measured -4.2 points [-6.7, -1.7] (8 agents, 5 questions, 240 prompts), target within 2.5"),
    case("eval_kvcomm_a8q5_cpu.json", 0.1, id="a8q5-r0.1"),
    case("eval_kvcomm_a8q5_cpu.json", 0.2, id="a8q5-r0.2"),
])
def test_kvcomm_accuracy_against_dense(name, recompute):
    """Issue 14: "accuracy on the reference task within 2.5 points of dense prefill, with a paired CI", at the
    default gamma 0.5 and V 20, first-agent base (previous checkpoint). Reference task: 5 agents, 3 questions,
    200 prompts (r0: -2.0 points, CI [-4.0, -0.5]); a8q5: the harder held-out setting chosen before running."""
    data = result(name)
    [config] = [c for c in data["configs"] if c["gamma"] == 0.5 and c["capacity"] == 20
                and c["recompute"] == recompute and c.get("recompute_by", "doubt") == "doubt"]
    assert data["base"] == "first-agent"
    assert config["accuracy"]["value"] - data["dense_accuracy"]["value"] >= -0.025 - EPS


# --- issue 15: the serving engine ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, transport", [
    case(name, transport, id=f"{name[len('serving_cpu_against_'):-len('.json')]}-{transport}", miss={
        ("serving_cpu_against_aio_16.json", "text"): "issue 15: measured 4.81x (345 vs 72 tok/s), target 5x",
        ("serving_cpu_against_aio_16c.json", "local"): "issue 15: measured 4.75x (310 vs 65 tok/s), target 5x",
    }.get((name, transport)))
    for name in ("serving_cpu_against_aio.json", "serving_cpu_against_aio_16.json",
                 "serving_cpu_against_aio_16b.json", "serving_cpu_against_aio_16c.json")
    for transport in ("text", "local")])
def test_serving_token_throughput_at_16(name, transport):
    """Issue 15: "target at concurrency 16: at least 5x today's token throughput": the scheduler against the engine
    at filing (9959479) in one run, generated tokens/s; the four runs of the final server (grpc.aio)."""
    data = result(name)
    assert data["against"] == "9959479"
    level = {r["engine"]: r for r in data["rows"] if r["transport"] == transport and r["concurrency"] == 16}
    assert level["scheduler"]["generated_token_throughput"] >= 5 * level["before"]["generated_token_throughput"]


@pytest.mark.parametrize("transport", ["text", "local"])
def test_serving_ttft_at_1_no_worse(transport):
    """Issue 15: "with concurrency-1 TTFT no worse": the scheduler's median TTFT at 1 against the engine at filing
    (serving_cpu_against_aio.json: 0.52x text, 0.31x local)."""
    data = result("serving_cpu_against_aio.json")
    level = {r["engine"]: r for r in data["rows"] if r["transport"] == transport and r["concurrency"] == 1}
    assert level["scheduler"]["median_ttft_ms"] <= level["before"]["median_ttft_ms"]


def test_soak_30_minutes_bounded_memory():
    """Issues 15 and 16: "a 30-minute soak with bounded memory" (soak_cpu.json): 30 minutes, nothing failed, the
    store never above its budget, and resident memory after the first tenth of the run grew less than the run's
    own limit (config max_growth_mib; 32.6 of 256 MiB)."""
    data = result("soak_cpu.json")
    samples = data["samples"]
    assert data["summary"]["duration_s"] >= 30 * 60 and data["summary"]["completed"] > 0
    assert data["summary"]["failed"] == 0
    assert max(s["store"] for s in samples) <= data["store_budget_bytes"]
    settled = [s for s in samples if s["t"] >= 0.1 * samples[-1]["t"]]
    growth_mib = (max(s["rss"] for s in settled) - settled[0]["rss"]) / 2**20
    assert growth_mib < data["config"]["max_growth_mib"]


# --- issue 16: a hardened API -------------------------------------------------------------------------------------

def test_fuzzed_requests():
    """Issue 16: "at least 1,000 fuzzed gRPC requests give 0 UNKNOWN/INTERNAL, 0 hangs, and 0 crashes, and a normal
    workflow afterwards gives the same answer as before" (fuzz_cpu.json)."""
    data = result("fuzz_cpu.json")
    assert data["requests"] >= 1000 and sum(data["statuses"].values()) == data["requests"]
    for counts in [data["statuses"], *data["by_method"].values()]:
        assert not {"UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED"} & set(counts), counts
    assert data["unknown_or_internal"] == 0 and data["hangs"] == 0
    assert data["healthy_after"] is True
    assert data["answer_after"] == data["answer_before"] and data["answer_before"]


def test_cross_key_and_cross_session_references_refused():
    """Issue 16: "0 of N cross-key or cross-session references accepted" (fuzz_cpu.json: 300 references to another
    session's messages, 124 of them across API keys)."""
    data = result("fuzz_cpu.json")
    assert data["cross_session_references"] > 0 and data["cross_key_references"] > 0
    assert data["cross_session_accepted"] == 0


@pytest.mark.parametrize("name", ["chaos_kill_worker_cpu.json", "chaos_kill_worker_graphs_cpu.json",
                                  "chaos_kill_worker_staircase_cpu.json"])
def test_worker_killed_under_load(name):
    """Issue 16: "a Worker replica killed while 20 workflows run: 0 hung, and each completes via fallback or fails
    with UNAVAILABLE, with service restored by itself"; issue 44: work was in flight when the fault hit. Plain
    workflows, RunGraph debates, and staircase workflows."""
    data = result(name)
    assert data["workflows"] == 20 and data["in_flight_at_fault"] > 0
    assert data["hung"] == 0
    assert set(data["outcomes"]) <= {"OK", "UNAVAILABLE"}, data["outcomes"]
    assert sum(data["outcomes"].values()) == data["workflows"]
    assert isinstance(data["recovered_s"], (int, float))
    if "graph_recovered_s" in data:
        assert isinstance(data["graph_recovered_s"], (int, float))


def test_redis_restart_loses_nothing():
    """Issue 16: "a Redis restart during load loses 0 requests"; issue 44: work was in flight at the fault
    (chaos_redis_restart_cpu.json)."""
    data = result("chaos_redis_restart_cpu.json")
    assert data["in_flight_at_fault"] > 0 and data["hung"] == 0
    assert data["outcomes"] == {"OK": data["workflows"]}


@pytest.mark.parametrize("way", ["cancel", "grpc-deadline", "metadata-deadline"])
def test_a_client_that_leaves_stops_its_work(way):
    """Issue 16: "a request deadline or a client disconnect cancels all of the request's work on every replica"
    (chaos_client_leaves_cpu.json: workflows left mid-stream while their workers decoded)."""
    row = result("chaos_client_leaves_cpu.json")["ways"][way]
    assert row["workflows"] > 0 and row["stopped"] == row["workflows"]
    assert row["still_running"] == 0 and row["hung"] == 0


# --- issue 17: multi-node -----------------------------------------------------------------------------------------

def test_multinode_answer_equals_single_node():
    """Issue 17: a multi-node run with the Worker and Synthesizer on different nodes, KV crossing nodes, "the answer
    equal to the single-node one" (multinode_cpu.json)."""
    data = result("multinode_cpu.json")
    assert not set(data["placement"]["Worker"]) & set(data["placement"]["Synthesizer"])
    receipts = data["kv_receipts"]
    assert receipts and all(r["digest_ok"] for r in receipts)
    assert data["kv_bytes_crossed"] == sum(r["bytes"] for r in receipts) > 0
    assert data["answer_tokens"] == data["single_node_answer_tokens"] and data["answer_tokens"]


# --- issue 44: the core's refactor costs no speed -----------------------------------------------------------------

@pytest.mark.parametrize("figure", [
    case("tok_per_s/text@c16", id="tok_per_s-text"),
    case("tok_per_s/local@c16", id="tok_per_s-local"),
    case("median_ttft_ms/text@c16", id="median_ttft-text",
         miss="issue 44: measured text median TTFT 9.3% higher (324 vs 296 ms, medians of 5), target at most 3%"),
    case("median_ttft_ms/local@c16", id="median_ttft-local"),
])
def test_serving_at_16_at_most_3_percent_slower(figure):
    """Issue 44: "benchmarks/serving.py at concurrency 16 ... against the commit before the change, at least 5
    interleaved A/B repeats each, medians compared: at most 3% slower" (ab_serving_c16.json, the final code;
    throughput 0.971x text and 0.988x local, i.e. 3.0% and 1.2% slower)."""
    data = result("ab_serving_c16.json")
    this, against, repeats = ab_medians(data, figure)
    assert repeats >= 5
    slowdown = against / this if figure.startswith("tok_per_s") else this / against
    assert slowdown <= 1.03 + EPS


@pytest.mark.parametrize("mode", ["text", "cache_branch_point", "cache_sequential", "cache_calibrated",
                                  "cache_refresh", "cache_served", "cache_refresh_apart", "cache_served_apart"])
def test_synthesis_ttft_at_most_3_percent_slower(mode):
    """Issue 44: "benchmarks/synthesis_ttft.py (100m shape) against the commit before the change, at least 5
    interleaved A/B repeats each, medians compared: at most 3% slower" (ab_synthesis_ttft_100m_7x.json, the final
    code, 7 repeats, 4 branches of 512 tokens)."""
    this, against, repeats = ab_medians(result("ab_synthesis_ttft_100m_7x.json"), f"{mode}@512")
    assert repeats >= 5
    assert this <= 1.03 * against


@pytest.mark.parametrize("name", ["chaos_kill_synthesizer_cpu.json", "chaos_rolling_update_cpu.json"])
def test_issue_47_sessions_survive_the_loss_of_a_replica(name):
    """Issue 47: kill-synthesizer and rolling-update with sessions in use, the fault meeting work in flight:
    sessions lost, target 0; nothing hung; a Decode after the fault answers as before."""
    got = result(name)
    assert got["in_flight_at_fault"] >= 1 and got["hung"] == 0
    assert got["sessions_lost"] == 0 and got["decodes_differing"] == 0
    assert set(got["in_flight_outcomes"]) <= {"OK", "UNAVAILABLE"}


@pytest.mark.parametrize("mode", ["text", "cache_branch_point", "cache_sequential", "cache_calibrated",
                                  "cache_refresh", "cache_served", "cache_refresh_apart", "cache_served_apart"])
def test_issue_59_synthesis_ttft_within_3_percent_of_the_tree_before(mode):
    """Issue 59: "interleaved A/B against the tree before, >= 5 repeats, ... synthesis TTFT within 3%"
    (ab_synthesis_ttft_100m_house2_15x.json: the finished second pass against d8d8f99, 15 repeats)."""
    data = result("ab_synthesis_ttft_100m_house2_15x.json")
    this, against, repeats = ab_medians(data, f"{mode}@512")
    assert repeats >= 5 and data["against"].startswith("d8d8f99")
    assert this <= 1.03 * against


@pytest.mark.parametrize("side", ["text", "local"])
def test_issue_59_serving_c16_within_3_percent_of_the_tree_before(side):
    """Issue 59: serving c16 within 3% of the tree before (ab_serving_c16_house2_final.json, 9 repeats): throughput
    no more than 3% lower, median TTFT no more than 3% higher."""
    data = result("ab_serving_c16_house2_final.json")
    this, against, repeats = ab_medians(data, f"tok_per_s/{side}@c16")
    assert repeats >= 5 and this >= 0.97 * against
    this, against, _ = ab_medians(data, f"median_ttft_ms/{side}@c16")
    assert this <= 1.03 * against


@pytest.mark.parametrize("name", ["chaos_kill_synthesizer_cpu.json", "chaos_rolling_update_cpu.json",
                                  "chaos_kill_synthesizer_split_cpu.json", "chaos_rolling_update_split_cpu.json"])
def test_issue_61_kv_path_sessions_survive_and_a_drain_hands_over(name):
    """Issue 61: kill-synthesizer and rolling-update with sessions made by RunWorkflow over grpc and local as well
    as text, work asserted in flight: sessions lost 0; for the drain, messages re-encoded after a rolling update at
    most 10% of those held."""
    got = result(name)
    kinds = set(got["sessions_by_kind"])
    assert {"chat", "workflow over text"} <= kinds and kinds & {"workflow over local", "workflow over grpc"}
    assert got["in_flight_at_fault"] >= 1 and got["hung"] == 0 and got["sessions_lost"] == 0
    assert got["decodes_differing"] == 0 and set(got["in_flight_outcomes"]) <= {"OK", "UNAVAILABLE"}
    if got["config"]["fault"] == "rolling-update":
        assert got["recompute"]["held_messages"] >= 1
        assert got["recompute"]["messages"] <= 0.1 * got["recompute"]["held_messages"]


# --- the stamp rule itself ----------------------------------------------------------------------------------------

def test_known_unclean_lists_only_files_a_target_reads():
    """KNOWN_UNCLEAN stays exact the other way too: a name no target reads any more is taken off."""
    source = Path(__file__).read_text()
    read = set(re.findall(r'"([\w.-]+\.json)"', source)) | {MANIFEST}
    assert KNOWN_UNCLEAN <= read, KNOWN_UNCLEAN - read


@pytest.mark.parametrize("stamp, listed, outcome", [
    ({"commit": "a" * 40, "dirty": False}, False, "passed"),
    ({"commit": "a" * 40, "dirty": False}, True, "take it off KNOWN_UNCLEAN"),
    ({"commit": "a" * 40, "dirty": True}, False, "dirty tree at commit aaaaaaa"),
    ({"commit": "a" * 40, "dirty": None, "backfilled": True}, False, "backfilled stamp"),
    (None, False, "no stamp"),
    ({"commit": "a" * 40, "dirty": True}, True, "xfail: probe.json: dirty tree at commit aaaaaaa"),
])
def test_clean_fails_a_target_read_from_an_unclean_file(monkeypatch, stamp, listed, outcome):
    monkeypatch.setitem(globals(), "KNOWN_UNCLEAN", {"probe.json"} if listed else set())
    data = {"x": 1} if stamp is None else {"stamp": stamp, "x": 1}
    try:
        got = clean("probe.json", data)
    except pytest.xfail.Exception as e:
        got = f"xfail: {e}"
    except (pytest.fail.Exception, AssertionError) as e:
        got = str(e)
    assert got == data if outcome == "passed" else outcome in got
