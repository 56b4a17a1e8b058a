"""Another git revision of this tree, importable beside it: for benchmarks that run both, side by side.

`sides(rev, tmp)` checks the revision out with `git worktree` and gives a PYTHONPATH for each side, under which
`import braid` is that side's code (a `braid` package whose subpackages link to the checkout's folders, as its
pyproject maps them), whatever braid is installed. A benchmark runs its measuring processes under each in turn.
"""

import os
import subprocess
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True).stdout.strip()


def labels(against: str) -> tuple[str, str]:
    """(this tree's commit, `against`'s), short; this tree's marked `+changes` when it has uncommitted ones."""
    head = git("rev-parse", "--short", "HEAD")
    if git("status", "--porcelain", "--untracked-files=no"):
        head += "+changes"
    return head, git("rev-parse", "--short", against)


def package(tree: str, dest: str) -> str:
    """A directory to put on PYTHONPATH so that `import braid` is checkout `tree`'s."""
    tree = os.path.abspath(tree)  # (the links it makes must not resolve against their own directory)
    with open(os.path.join(tree, "pyproject.toml"), "rb") as f:
        dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    pkg = os.path.join(dest, "braid")
    os.makedirs(pkg)
    for name in os.listdir(os.path.join(tree, dirs["braid"])):
        os.symlink(os.path.join(tree, dirs["braid"], name), os.path.join(pkg, name))
    for name, folder in dirs.items():
        if name != "braid":
            os.symlink(os.path.join(tree, folder), os.path.join(pkg, name.split(".", 1)[1]))
    return dest


@contextmanager
def sides(against: str, tmp: str) -> Iterator[dict[str, str]]:
    """{"this tree": PYTHONPATH, <against's short commit>: PYTHONPATH}; the checkout is removed afterwards."""
    rev = git("rev-parse", "--short", against)
    tree = os.path.join(tmp, "tree")
    try:
        git("worktree", "add", "--detach", "-q", tree, rev)
        yield {"this tree": package(ROOT, os.path.join(tmp, "this")), rev: package(tree, os.path.join(tmp, "rev"))}
    finally:
        if os.path.exists(tree):
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=False)
        subprocess.run(["git", "-C", ROOT, "worktree", "prune"], check=False)
