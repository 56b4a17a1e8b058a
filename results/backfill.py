"""Stamp results files written before the measurement contract, from the git history, without guessing.

`python -m braid.results.backfill [DIR]` (default: benchmarks/results) adds a `stamp` to every JSON there that
has none. What the file itself records is kept (its `fingerprint` or `base_fingerprint`, `device`, `torch`);
the commit is the one that last wrote its content (a result is committed with the code it measured, or just
after it; a commit that only renamed the file does not count); everything else is "unknown". Such a stamp says `"backfilled": true`, and its `dirty` is null.
"""

import argparse
import json
import os
import sys

from braid.results import ROOT, UNKNOWN, _git


def _device(name: str, result: dict) -> tuple[str, str]:
    """(device, device_name) from what the file says: its `device` field, else its name's suffix (the
    benchmarks name their files `<what>_cpu` or `<what>_cuda` after the device they ran on)."""
    said = result.get("device")
    stem = os.path.splitext(name)[0]
    if isinstance(said, str) and said:
        if said == "cpu" or said.startswith("cuda"):
            return said, said if said == "cpu" else UNKNOWN
        return "cuda", said  # (a GPU's name, as device_name wrote it)
    if stem.endswith("_cpu") or "_cpu_" in stem:
        return "cpu", "cpu"
    if any(s in stem for s in ("_cuda", "_gpu")):
        return "cuda", UNKNOWN
    return UNKNOWN, UNKNOWN


def last_written(rel: str, at: str = "HEAD") -> tuple[str, str]:
    """(commit, its date) of the last commit up to `at` that wrote the content of the file at `rel`, following it
    through renames; a commit that only renamed it (similarity 100) does not count. (UNKNOWN, UNKNOWN): none."""
    log = _git("log", "--follow", "--format=@%H %cI", "--name-status", at, "--", rel) or ""
    commit = None
    for line in log.splitlines():
        if line.startswith("@"):
            commit = line[1:].split()
        elif line.strip() and commit is not None and line.split("\t")[0] != "R100":
            return commit[0], commit[1]
    return UNKNOWN, UNKNOWN


def backfilled_stamp(path: str, result: dict, at: str = "HEAD") -> dict:
    """The stamp for an unstamped results file at `path` (see the module's docstring), from the history up to
    revision `at`."""
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    commit, written = last_written(rel, at)
    device, name = _device(os.path.basename(path), result)
    model = result.get("fingerprint") or result.get("base_fingerprint") or UNKNOWN
    torch_version = result.get("torch") if isinstance(result.get("torch"), str) else UNKNOWN
    return {"commit": commit, "dirty": None, "model": model, "calibration": UNKNOWN, "device": device,
            "device_name": name, "torch": torch_version, "written": written, "backfilled": True}


def backfill(directory: str) -> list[str]:
    """Stamp every unstamped JSON in `directory`; the files stamped."""
    done = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not name.endswith(".json"):
            continue
        with open(path) as f:
            result = json.load(f)
        if "stamp" in result:
            continue
        with open(path) as f:
            text = f.read()
        # the stamp goes in first, the rest kept as written (a diff of one line, not of the whole file)
        opening = text.index("{") + 1
        stamp = backfilled_stamp(path, result)
        rest = text[opening:] if text[opening].isspace() else " " + text[opening:]
        text = f'{text[:opening]}"stamp": {json.dumps(stamp)},{rest}'
        assert json.loads(text) == {"stamp": stamp, **result}
        with open(path, "w") as f:
            f.write(text)
        done.append(name)
    return done


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m braid.results.backfill", description=__doc__.splitlines()[0])
    p.add_argument("directory", nargs="?", default=os.path.join(ROOT, "benchmarks", "results"),
                   help="where the results files are (default: benchmarks/results)")
    args = p.parse_args(argv)
    done = backfill(args.directory)
    print(f"stamped {len(done)} file(s) in {args.directory}" + "".join(f"\n  {n}" for n in done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
