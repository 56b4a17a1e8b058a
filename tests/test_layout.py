"""The rooms import only downward, and no modules import each other in a circle.

The core (engine) never imports a method; the methods never import the API, the cluster or the deployments;
model math never imports Ray or gRPC; deployments never import the wiring that builds them; training does not
import evaluation; load tests, benchmarks and evaluations only look down. Imports inside functions count as
much as those at the top of a module (a lazy import is still a dependency); imports under `if TYPE_CHECKING`
(annotations only, never run) do not."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOMS = ["results", "engine", "kernels", "protos", "kv", "methods", "runtime", "api", "workers", "synthesizer",
         "cluster", "models", "evals", "train", "loadtest", "braid"]
SERVING = {"braid.api", "braid.workers", "braid.synthesizer", "braid.cluster", "braid.cli"}
# room -> what it must never import (braid.<room> or a third-party top-level name)
FORBIDDEN = {
    # how every benchmark, evaluation and training run writes its result: below everything that measures
    "results": {"ray", "grpc", "braid.engine", "braid.methods", "braid.kv", "braid.runtime", "braid.models",
                "braid.evals", "braid.train", "braid.loadtest", "braid.kernels", "braid.protos"} | SERVING,
    "engine": {"ray", "grpc", "redis", "peft", "braid.methods", "braid.kv", "braid.runtime", "braid.models",
               "braid.evals", "braid.train", "braid.protos", "braid.loadtest"} | SERVING,
    "kernels": {"ray", "grpc", "braid.engine", "braid.methods", "braid.kv", "braid.runtime"} | SERVING,
    "methods": {"ray", "grpc", "redis", "braid.kv", "braid.runtime", "braid.protos", "braid.evals", "braid.train",
                "braid.loadtest"} | SERVING,
    "kv": {"ray", "braid.runtime", "braid.loadtest", "braid.evals", "braid.train"} | SERVING,
    "runtime": {"braid.loadtest", "braid.evals", "braid.train"} | SERVING,
    "api": {"braid.workers", "braid.synthesizer", "braid.cluster", "braid.cli", "braid.evals", "braid.train",
            "braid.loadtest"},
    "workers": {"braid.cluster", "braid.cli", "braid.synthesizer", "braid.api", "braid.evals", "braid.train",
                "braid.loadtest"},
    # (colocated, a Synthesizer replica plays the worker's role too: it may run a worker's runner)
    "synthesizer": {"braid.cluster", "braid.cli", "braid.api", "braid.evals", "braid.train", "braid.loadtest"},
    "models": {"ray", "grpc", "braid.engine", "braid.methods", "braid.runtime", "braid.kv", "braid.evals",
               "braid.train", "braid.loadtest"} | SERVING,
    "evals": {"ray", "grpc", "braid.kv", "braid.runtime", "braid.train", "braid.loadtest"} | SERVING,
    "train": {"ray", "grpc", "braid.kv", "braid.runtime", "braid.evals", "braid.loadtest"} | SERVING,
    "cluster": {"braid.cli", "braid.loadtest", "braid.evals", "braid.train"},
    "loadtest": {"braid.cli", "braid.evals", "braid.train"},
    "benchmarks": {"braid.cli"},
    # the docs' generators and build hooks read the schemas and the results; they run nothing
    "docs": {"ray", "redis", "braid.engine", "braid.methods", "braid.kv", "braid.runtime"} | SERVING,
}


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING"
                                         or getattr(test, "attr", None) == "TYPE_CHECKING")


def imports(path: str, module: str = "") -> set[str]:
    """Every module `path` imports, anywhere in it (inside functions too), relative imports resolved against
    `module` (its dotted name); `from a import b` names a.b (b may be a module)."""
    tree = ast.parse(open(path).read())
    skip = {id(n) for node in ast.walk(tree) if _type_checking_only(node) for n in ast.walk(node)}
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
    return names


def room_files(room: str):
    folder = os.path.join(ROOT, room)
    return [os.path.join(d, f) for d, _, files in os.walk(folder) for f in sorted(files) if f.endswith(".py")]


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return "braid" if rel == ["braid"] else ".".join(["braid"] + (rel[1:] if rel[0] == "braid" else rel))


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_rooms_import_only_downward(room):
    bad = []
    for path in room_files(room):
        for name in imports(path, module_name(path)):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[room]):
                bad.append(f"{os.path.relpath(path, ROOT)} imports {name}")
    assert not bad, bad


def test_every_room_has_rules():
    """A new top-level folder of Python code gets its rules here before it can import anything."""
    rooms = {d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d)) and not d.startswith(".")
             and any(f.endswith(".py") for f in os.listdir(os.path.join(ROOT, d)))}
    assert rooms - {"tests", "protos", "braid"} <= set(FORBIDDEN), rooms - set(FORBIDDEN)


def _module_graph() -> dict[str, set[str]]:
    modules = {}
    for room in ROOMS:
        for path in room_files(room):
            modules[module_name(path)] = path
    return {m: {n for n in imports(p, m) if n in modules and n != m} for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        m = stack.pop()
                        on.discard(m)
                        component.append(m)
                        if m == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def test_no_import_cycles():
    graph = _module_graph()
    # a package's __init__ that re-exports its modules is imported by them only through their own names
    for m in graph:
        graph[m] = {n for n in graph[m] if not m.startswith(n + ".")}
    assert not _cycles(graph), _cycles(graph)


def test_the_cycle_finder_finds_a_lazy_cycle(tmp_path):
    """The check above can fail: two modules that import each other, one of them inside a function."""
    (tmp_path / "a.py").write_text("from braid.x import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from braid.x import a\n")
    graph = {f"braid.x.{m}": {n for n in imports(str(tmp_path / f"{m}.py"), f"braid.x.{m}")
                              if n in ("braid.x.a", "braid.x.b")} for m in "ab"}
    assert _cycles(graph) == [["braid.x.a", "braid.x.b"]]


def test_everything_imports_through_the_braid_namespace():
    """No module imports the old top-level names (engine, cluster, ...), which would collide in a user's env."""
    bad = []
    for room in ROOMS + ["tests", "benchmarks", "docs"]:
        folder = os.path.join(ROOT, room)
        for path in [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".py")]:
            for name in imports(path):
                if name.split(".")[0] in ROOMS[:-1]:
                    bad.append(f"{os.path.relpath(path, ROOT)} imports {name}")
    assert not bad, bad
