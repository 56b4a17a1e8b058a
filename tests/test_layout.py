"""The rooms stand on floors and import only the floors below their own; no modules import each other in a circle.

A room never imports a room on its own floor or above: the core (engine) never imports a method or the API's
protos; kv and the methods, side by side, never import each other; the methods never import the API, the
cluster or the deployments; deployments never import the wiring that builds them; training and evaluation
never import each other; load tests, benchmarks and evaluations only look down. Model math never imports Ray
or gRPC (THIRD_PARTY). Imports inside functions count as much as those at the top of a module (a lazy import is
still a dependency); imports under `if TYPE_CHECKING` (annotations only, never run) do not."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# lowest first; "braid" is the package's own modules (the CLI), "docs" the docs' generators and build hooks
FLOORS = [
    ["results", "kernels", "models"],  # how results are written; key re-rotation; the reference model, its tasks
    ["engine", "protos", "docs"],  # the core; the API's schemas; the docs' generators (they read results, run nothing)
    ["kv", "methods"],  # moving KV between engines; the multi-agent methods on the core's public API
    ["runtime", "evals", "train"],  # what the deployments share; evaluation; training
    ["api", "workers"],  # the agent API and its ingress; the worker role
    ["synthesizer"],  # colocated, a Synthesizer replica plays the worker's role too (it runs a worker's runner)
    ["cluster"],  # wiring: Ray, Serve, Redis, the in-process server
    ["loadtest"],
    ["braid", "benchmarks"],  # the CLI; the benchmarks
]
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
ROOMS = [room for room in FLOOR if room not in ("docs", "benchmarks")]  # the rooms of the braid.* namespace
# third-party packages a room must never import (whatever its floor)
SERVICES = {"ray", "grpc", "redis"}
THIRD_PARTY = {"results": SERVICES, "kernels": SERVICES, "models": SERVICES, "engine": SERVICES | {"peft"},
               "protos": {"ray", "redis", "torch"}, "docs": {"ray", "redis", "torch"}, "kv": {"ray", "redis"},
               "methods": SERVICES, "evals": SERVICES, "train": SERVICES}


# pairs the floors alone would allow that stay apart: the core reads no test checkpoints' helpers, the methods speak
# no API, evaluation and training move no KV between processes, and nothing served runs an evaluation or training
APART = {"engine": {"models"}, "methods": {"protos"}, "evals": {"kv"}, "train": {"kv"},
         **{room: {"evals", "train"} for room in ("api", "workers", "synthesizer", "cluster", "loadtest")}}


def room_of(name: str) -> str | None:
    """The room a module name lies in (None: not Braid's); braid.cli and the package itself are the "braid" room."""
    parts = name.split(".")
    if parts[0] != "braid":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in FLOOR else "braid"


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


def violations(room: str, paths, module=None) -> list[str]:
    """What these files of `room` import that they must not: a room on their floor or above, or a third-party
    package the room keeps out. `module(path)`: its dotted name (default: where it lies in this tree)."""
    bad = {}  # (file, what it reaches) -> the first name that reaches it
    for path in paths:
        for name in sorted(imports(str(path), (module or module_name)(path))):
            target, where = room_of(name), os.path.relpath(path, ROOT)
            if target is not None and target != room and FLOOR[target] >= FLOOR[room]:
                bad.setdefault((where, target), f"{where} imports {name} ({target}: floor {FLOOR[target]}, {room} "
                                                f"stands on {FLOOR[room]})")
            elif target in APART.get(room, ()):
                bad.setdefault((where, target), f"{where} imports {name} ({room} and {target} stay apart)")
            elif name.split(".")[0] in THIRD_PARTY.get(room, ()):
                bad.setdefault((where, name.split(".")[0]), f"{where} imports {name}")
    return list(bad.values())


@pytest.mark.parametrize("room", sorted(FLOOR))
def test_rooms_import_only_the_floors_below(room):
    bad = violations(room, room_files(room))
    assert not bad, bad


def test_the_floors_check_refuses_a_sibling_an_upper_floor_and_a_service(tmp_path):
    """The check above can fail: kv importing a method (its floor's neighbour, lazily), kernels importing train
    (above), the engine importing the API's protos (beside it) or Ray; the engine importing kernels passes."""
    files = {"kv": "def f():\n    from braid.methods import synthesis\n", "kernels": "import braid.train.calibrate\n",
             "engine": "from braid.protos import agent_pb2\nimport ray\nfrom braid.kernels import rerotate\n",
             "evals": "from braid.kv import connector\nfrom braid.engine import Engine\n"}
    for room, text in files.items():
        (tmp_path / f"{room}.py").write_text(text)
    found = {room: violations(room, [tmp_path / f"{room}.py"], lambda p: f"braid.{p.stem}.x") for room in files}
    assert [len(found[r]) for r in files] == [1, 1, 2, 1], found
    assert found["kv"][0].endswith("imports braid.methods (methods: floor 2, kv stands on 2)")
    assert found["engine"][1].endswith("imports ray")
    assert found["evals"][0].endswith("imports braid.kv (evals and kv stay apart)")


def test_every_room_stands_on_a_floor():
    """A new top-level folder of Python code is placed on a floor before it can import anything."""
    rooms = {d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d)) and not d.startswith(".")
             and any(f.endswith(".py") for f in os.listdir(os.path.join(ROOT, d)))}
    assert rooms - {"tests"} <= set(FLOOR), rooms - set(FLOOR)


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
                if name.split(".")[0] in ROOMS and name.split(".")[0] != "braid":
                    bad.append(f"{os.path.relpath(path, ROOT)} imports {name}")
    assert not bad, bad
