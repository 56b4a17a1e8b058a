"""Every command the README and the docs show is checked as written, so a reader never meets a stale flag.

Commands are the `$ ` lines of ```console blocks (with their `\\` continuations), split at `&&`. Each is checked
as far as this machine allows:
- `braid ...`, `python -m braid....`, `python benchmarks/....py`: run up to the end of their argument parsing
  (argparse is stopped right after it parses, so nothing is served or measured); a flag that does not exist,
  or a value it refuses, fails the test;
- `helm install|template`: the chart rendered with the `--set` values given;
- the set-up commands: the test command is the one `.ci/run` runs, and the extras they install exist;
- `docker`, `kubectl`, `serve deploy` and the like need a daemon or a cluster this machine does not have:
  they are listed in UNCHECKED, and nothing else may go unchecked.
The README's Python client is run against a real in-process server; the README stays a short user's guide.
"""

import glob
import os
import re
import shlex
import subprocess
import sys
import tomllib

import helm_python as helm
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                           recursive=True))]
# programs a reader runs against a daemon or cluster that this machine lacks: checked by nothing here
UNCHECKED = {"docker", "kubectl", "serve", "openssl", "curl", "grpcurl", "cd", "export", "git", "ray"}
README_MAX_LINES = 300

# Stops any argparse-based program right after it parsed its arguments (its real parser, its real flags).
PARSE_ONLY = """
import argparse, os, runpy, sys
_parse = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    _parse(self, args, namespace)
    print("BRAID-ARGS-OK", flush=True)
    os._exit(0)
argparse.ArgumentParser.parse_args = parse_args
kind, target, *argv = sys.argv[1:]
sys.argv = [target, *argv]
if kind == "cli":
    from braid.cli import main
    sys.exit(main(argv))
elif kind == "module":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
"""


def console_commands(page: str) -> list[str]:
    """The commands of `page`'s console blocks, continuations joined."""
    commands, block, current = [], None, None
    for line in open(os.path.join(ROOT, page)):
        line = line.rstrip("\n")
        fence = re.match(r"\s*```(\w*)", line)
        if fence:
            block = None if block is not None else fence.group(1)
            continue
        if block != "console":
            continue
        text = line.strip()
        if current is not None:
            current += " " + text.rstrip("\\").strip()
            if not text.endswith("\\"):
                commands.append(current)
                current = None
        elif text.startswith("$ "):
            current = text[2:].rstrip("\\").strip()
            if not text.endswith("\\"):
                commands.append(current)
                current = None
    return commands


def simple_commands(command: str) -> list[list[str]]:
    """`command` split at `&&` into argument lists, each cut at a pipe or redirect, leading VAR=value dropped."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars="|&><;")
    lexer.whitespace_split = True
    out, words = [], []
    for token in [*lexer, "&&"]:
        if token in ("&&", ";", "||"):
            while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                words.pop(0)
            if words:
                out.append(words)
            words = []
        elif token in ("|", ">", ">>", "<", "&"):
            words.append(None)  # (the rest of this simple command is another program or a file)
        else:
            words.append(token)
    return [w[:w.index(None)] if None in w else w for w in out]


CASES = [(page, cmd) for page in PAGES for cmd in console_commands(page)]


def _program(words: list[str]) -> str:
    return os.path.basename(words[0])


def _parse_only(kind: str, target: str, argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", PARSE_ONLY, kind, target, *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    ok = done.returncode == 0 and ("BRAID-ARGS-OK" in done.stdout or "usage:" in done.stdout)
    assert ok, f"{target} {' '.join(argv)}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


def _helm_set(values: dict, assignment: str) -> None:
    key, _, raw = assignment.partition("=")
    value = yaml.safe_load(raw) if raw else ""
    node = values
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def check(words: list[str]) -> None:
    program = _program(words)
    if program in ("braid",):
        _parse_only("cli", "braid", words[1:])
    elif program.startswith("python"):
        if words[1:3] == ["-m", "venv"]:
            return
        if words[1:3] == ["-m", "pytest"]:
            return  # (the test command itself: checked against .ci/run below)
        if words[1] == "-m":
            _parse_only("module", words[2], words[3:])
        else:
            assert os.path.isfile(os.path.join(ROOT, words[1])), f"no script {words[1]}"
            _parse_only("path", words[1], words[2:])
    elif program == "pip":
        extras = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["optional-dependencies"]
        for word in words:
            for extra in re.findall(r"\.\[([\w,]+)\]", word):
                assert set(extra.split(",")) <= set(extras), f"pip installs extras {extra} of {list(extras)}"
    elif program == "helm":
        assert words[1] in ("install", "upgrade", "template", "lint"), words
        rest, values, namespace = words[2:], {}, "default"
        positional = []
        while rest:
            word = rest.pop(0)
            if word == "--set":
                _helm_set(values, rest.pop(0))
            elif word in ("--namespace", "-n"):
                namespace = rest.pop(0)
            elif word in ("-f", "--values"):
                with open(os.path.join(ROOT, rest.pop(0))) as f:
                    values.update(yaml.safe_load(f))
            elif word.startswith("-"):
                assert word in ("--create-namespace", "--wait", "--install"), f"helm flag {word} is not checked here"
            else:
                positional.append(word)
        chart = positional[-1] if words[1] != "lint" else positional[0]
        rendered = helm.Chart.load(os.path.join(ROOT, chart)).render(values, name=positional[0], namespace=namespace)
        assert any(path.endswith(".yaml") for path in rendered)
    elif program == "mkdocs":
        assert words[1] in ("serve", "build"), words  # (tests/test_docs.py builds the site)
    else:
        assert program in UNCHECKED, f"{' '.join(words)}: a command this test does not know how to check"


@pytest.mark.parametrize("page,command", CASES, ids=[f"{p}:{c[:60]}" for p, c in CASES])
def test_command_as_written(page, command):
    for words in simple_commands(command):
        check(words)


def test_every_page_with_commands_is_found():
    assert [c for p, c in CASES if p == "README.md"], "the README shows no console commands"


def test_the_readme_set_up_is_what_ci_runs():
    commands = console_commands("README.md")
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    tests = [c for c in commands if "pytest" in c]
    assert len(tests) == 1 and tests[0] in ci, (tests, ci)
    assert any(c.endswith("braid serve") and "pip install" in c for c in commands)


def test_the_readme_is_a_short_guide_and_its_links_resolve():
    text = open(os.path.join(ROOT, "README.md")).read()
    assert len(text.splitlines()) <= README_MAX_LINES
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+://", target):
            assert os.path.exists(os.path.join(ROOT, target)), f"README links to {target}, which does not exist"


def python_blocks(page: str) -> list[str]:
    blocks, current = [], None
    for line in open(os.path.join(ROOT, page)):
        if re.match(r"\s*```python\s*$", line):
            current = []
        elif current is not None and re.match(r"\s*```\s*$", line):
            blocks.append("".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_the_readme_python_client_runs_against_a_server(tmp_path, monkeypatch, capsys):
    """The client as written (its address and key file moved to this test's server)."""
    from braid.api.auth import ApiKeys
    from braid.cluster.inprocess import start_in_process
    from braid.engine import EngineConfig
    from braid.methods.calibration import load_engine
    from braid.models import REFERENCE_MODEL
    from braid.runtime.directory import Directory, EmbeddedRedis

    (client,) = [b for b in python_blocks("README.md") if "AgentServiceStub" in b]
    redis = EmbeddedRedis()
    server = start_in_process(load_engine(EngineConfig(REFERENCE_MODEL, device="cpu")), Directory.connect(redis.url),
                              keys=ApiKeys.parse(["reader:readme-key-0123456789abcdef"], "test"))
    try:
        monkeypatch.setenv("HOME", str(tmp_path))
        (tmp_path / ".braid").mkdir()
        (tmp_path / ".braid" / f"api-key-{server.port}").write_text("readme-key-0123456789abcdef\n")
        exec(compile(client.replace("9000", str(server.port)), "README.md", "exec"), {})
    finally:
        server.stop()
        redis.stop()
    out = capsys.readouterr().out
    assert "transport: TRANSPORT_" in out and re.search(r"answer: .+ session: \S+", out), out
    assert "confidence 8, answer 70" in out, out  # (the chat messages rendered as the reference model reads them)
