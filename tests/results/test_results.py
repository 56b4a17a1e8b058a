"""The measurement contract: every results file says what was measured where (braid.results), and every
benchmark, evaluation and load test writes through it."""

import ast
import json
import os
import re
import subprocess

import pytest
import torch

from braid.engine import EngineConfig
from braid.methods.calibration import fingerprints, fingerprints_at, load_engine
from braid.models import REFERENCE_MODEL
from braid.results import NONE, ROOT, STAMP_FIELDS, UNKNOWN, stamp, unclean, write_json, write_json_to
from braid.results.backfill import backfill

RESULTS = os.path.join(ROOT, "benchmarks", "results")
COMMITTED = sorted(f for f in os.listdir(RESULTS) if f.endswith(".json"))
HEX = re.compile(r"[0-9a-f]{40}")


def _known_commit(sha: str) -> bool:
    found = subprocess.run(["git", "-C", ROOT, "cat-file", "-e", f"{sha}^{{commit}}"], capture_output=True)
    return found.returncode == 0


@pytest.mark.parametrize("name", COMMITTED)
def test_every_committed_result_is_stamped(name):
    with open(os.path.join(RESULTS, name)) as f:
        got = json.load(f)["stamp"]
    assert set(STAMP_FIELDS) <= set(got), f"{name}: its stamp lacks {set(STAMP_FIELDS) - set(got)}"
    assert got["commit"] == UNKNOWN or (HEX.fullmatch(got["commit"]) and _known_commit(got["commit"])), got["commit"]
    assert got["dirty"] in (True, False, None)
    assert got["device"] in ("cpu", UNKNOWN) or got["device"].startswith("cuda"), got["device"]
    for field in ("model", "calibration", "torch", "device_name", "written"):
        assert isinstance(got[field], str) and got[field], f"{name}: stamp field {field} is {got[field]!r}"
    if got.get("backfilled"):
        assert got["dirty"] is None  # (not known afterwards)


SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize("result, why", [
    ({"stamp": {"commit": SHA, "dirty": False}}, None),
    ({"stamp": {"commit": SHA, "dirty": False}, "this": "0123456", "against": "89abcde"}, None),
    ({"stamp": {"commit": SHA, "dirty": True}, "this": "0123456+changes"}, "dirty tree at commit 0123456"),
    ({"rows": []}, "no stamp"),
    ({"stamp": {"commit": SHA, "dirty": True}}, "dirty tree at commit 0123456"),
    ({"stamp": {"commit": SHA, "dirty": None}}, "not known whether the tree at commit 0123456 was clean"),
    ({"stamp": {"commit": UNKNOWN, "dirty": None}}, "its stamp names no commit"),
    ({"stamp": {"commit": SHA, "dirty": None, "backfilled": True}},
     ("backfilled stamp: never measured under the stamp contract (its commit, 0123456, is the last that wrote the "
      "file)")),
    # the commit its own record names: a backfilled stamp names the commit that committed the file instead
    ({"stamp": {"commit": SHA, "dirty": None, "backfilled": True}, "this": "fedcba9+changes"},
     ("backfilled stamp: never measured under the stamp contract (its commit, 0123456, is the last that wrote the "
      "file); its record says it measured fedcba9 with uncommitted changes, its stamp 0123456")),
    ({"stamp": {"commit": SHA, "dirty": False}, "this": "0123456+changes"},
     "its record says it measured 0123456 with uncommitted changes, its stamp 0123456"),
])
def test_unclean_says_why_a_result_does_not_stand(result, why):
    assert unclean(result) == why


def test_write_json_stamps_the_checkout_and_the_fingerprints(tmp_path):
    stem = write_json(str(tmp_path), "probe_cpu", {"rows": [1, 2]}, device="cpu", model="abc", calibration=None)
    with open(stem + ".json") as f:
        got = json.load(f)
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert got["rows"] == [1, 2]
    assert got["stamp"]["commit"] == head and isinstance(got["stamp"]["dirty"], bool)
    assert got["stamp"]["model"] == "abc" and got["stamp"]["calibration"] == NONE
    assert (got["stamp"]["device"], got["stamp"]["device_name"], got["stamp"]["torch"]) == ("cpu", "cpu",
                                                                                             torch.__version__)


def test_the_commit_can_be_named_where_there_is_no_checkout(monkeypatch, tmp_path):
    """A copy of the tree on a device machine has no .git: the device script passes the commit along."""
    monkeypatch.setenv("BRAID_COMMIT", "f" * 40)
    monkeypatch.setenv("BRAID_DIRTY", "1")
    got = stamp(device="cpu", model=None, calibration=None)
    assert (got["commit"], got["dirty"]) == ("f" * 40, True)
    stem = write_json_to(str(tmp_path / "sub" / "x.json"), {}, device="cpu", model=None, calibration=None)
    assert stem == str(tmp_path / "sub" / "x") and json.load(open(stem + ".json"))["stamp"]["commit"] == "f" * 40


def test_backfill_stamps_only_unstamped_files_and_keeps_what_they_say(tmp_path):
    old = {"fingerprint": "0123", "torch": "2.9.0", "rows": [{"a": 1.5}]}
    (tmp_path / "eval_old_cpu.json").write_text(json.dumps(old, indent=1))
    (tmp_path / "thing_cuda.json").write_text(json.dumps({"device": "NVIDIA H200"}))
    write_json(str(tmp_path), "new_cpu", {"x": 1}, device="cpu", model="m", calibration="c")
    before = (tmp_path / "new_cpu.json").read_text()
    assert sorted(backfill(str(tmp_path))) == ["eval_old_cpu.json", "thing_cuda.json"]
    got = json.loads((tmp_path / "eval_old_cpu.json").read_text())
    assert {k: v for k, v in got.items() if k != "stamp"} == old
    # (a file outside the repository has no history: its commit is unknown, never guessed)
    assert got["stamp"] | {"written": None} == {
        "commit": UNKNOWN, "dirty": None, "model": "0123", "calibration": UNKNOWN, "device": "cpu",
        "device_name": "cpu", "torch": "2.9.0", "written": None, "backfilled": True}
    gpu = json.loads((tmp_path / "thing_cuda.json").read_text())["stamp"]
    assert (gpu["device"], gpu["device_name"], gpu["model"]) == ("cuda", "NVIDIA H200", UNKNOWN)
    assert (tmp_path / "new_cpu.json").read_text() == before
    assert backfill(str(tmp_path)) == []


def test_fingerprints_of_an_engine_match_those_read_from_its_config():
    """A benchmark that measures a server in another process stamps what that server loads."""
    config = EngineConfig(REFERENCE_MODEL, device="cpu")
    engine = load_engine(config)
    assert fingerprints(engine) == fingerprints_at(config) and fingerprints(engine)["calibration"]
    assert fingerprints_at(EngineConfig(REFERENCE_MODEL, calibration="none")) == {"model": engine.fingerprint,
                                                                                   "calibration": None}


# Writers of a JSON that is not a result: (file, why)
NOT_RESULTS = {
    "benchmarks/cpu_threads.py": "a worker process's timings, read back by its parent, which writes the result",
    "evals/workflows.py": "--sample: recorded answers a test replays, not a measurement",
    "benchmarks/trace_quality.py": "the traces it served and their families: the calibration's input, not a result",
}


def test_every_measurement_writes_through_braid_results():
    """No benchmark, evaluation, load test or CLI command writes a results JSON of its own (json.dump to a file):
    each goes through braid.results.write_json, which stamps it."""
    offenders = []
    for room in ("benchmarks", "evals", "loadtest", "braid"):
        for folder, _, files in os.walk(os.path.join(ROOT, room)):
            for name in files:
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)
                if not name.endswith(".py") or rel in NOT_RESULTS:
                    continue
                for node in ast.walk(ast.parse(open(path).read())):
                    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "dump"
                            and getattr(node.func.value, "id", None) == "json"):
                        offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, f"results written without a stamp (use braid.results.write_json): {offenders}"
