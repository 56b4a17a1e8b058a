"""The rooms import only downward: model math never imports Ray or gRPC; deployments never import the
wiring that builds them; training does not import evaluation."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOMS = ["engine", "kernels", "protos", "kv", "api", "workers", "synthesizer", "cluster", "models", "evals", "train",
         "braid"]
# room -> what it must never import (braid.<room> or a third-party top-level name)
FORBIDDEN = {
    "engine": {"ray", "grpc", "redis", "braid.kv", "braid.api", "braid.workers", "braid.synthesizer", "braid.cluster",
               "braid.models", "braid.evals", "braid.train", "braid.cli", "braid.protos"},
    "kernels": {"ray", "grpc", "braid.engine", "braid.kv", "braid.api", "braid.cluster"},
    "kv": {"ray", "braid.api", "braid.workers", "braid.synthesizer", "braid.cluster", "braid.cli"},
    "api": {"braid.workers", "braid.synthesizer", "braid.cluster", "braid.cli", "braid.evals", "braid.train"},
    "workers": {"braid.cluster", "braid.cli", "braid.synthesizer"},
    "synthesizer": {"braid.cluster", "braid.cli"},
    "models": {"ray", "grpc", "braid.engine", "braid.api", "braid.kv", "braid.cluster", "braid.evals", "braid.train"},
    "evals": {"ray", "grpc", "braid.api", "braid.kv", "braid.cluster", "braid.train", "braid.cli"},
    "train": {"ray", "grpc", "braid.api", "braid.kv", "braid.cluster", "braid.evals", "braid.cli"},
    "cluster": {"braid.cli"},
}


def imports(path: str) -> set[str]:
    tree = ast.parse(open(path).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def room_files(room: str):
    folder = os.path.join(ROOT, room)
    return [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".py")]


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_rooms_import_only_downward(room):
    bad = []
    for path in room_files(room):
        for name in imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[room]):
                bad.append(f"{os.path.relpath(path, ROOT)} imports {name}")
    assert not bad, bad


def test_everything_imports_through_the_braid_namespace():
    """No module imports the old top-level names (engine, cluster, ...), which would collide in a user's env."""
    bad = []
    for room in ROOMS + ["tests", "benchmarks"]:
        folder = os.path.join(ROOT, room)
        for path in [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".py")]:
            for name in imports(path):
                if name.split(".")[0] in ROOMS[:-1]:
                    bad.append(f"{os.path.relpath(path, ROOT)} imports {name}")
    assert not bad, bad
