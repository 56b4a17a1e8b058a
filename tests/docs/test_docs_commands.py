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
import ipaddress
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib

import helm_python as helm
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                           recursive=True))]
# programs a reader runs against a daemon or cluster that this machine lacks: checked by nothing here
UNCHECKED = {"docker", "kubectl", "serve", "openssl", "curl", "grpcurl", "cd", "export", "git", "ray"}
README_MAX_LINES = 300

# A process that imports braid (and torch) once, then forks a child per command; the child stops its argparse-based
# program right after it parsed its arguments (its real parser, its real flags). One import instead of one per
# command: the commands' checks take seconds, not minutes.
PARSE_SERVER = """
import argparse, importlib, json, os, runpy, sys, tempfile, traceback
import braid.cli
def done(code):
    sys.stdout.flush()
    sys.stderr.flush()
    with open(LOADED, "w") as f:  # (what this command imported, for the server to import before the next fork)
        json.dump(sorted(set(sys.modules) - BEFORE), f)
    os._exit(code)
_parse = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    _parse(self, args, namespace)
    print("BRAID-ARGS-OK", flush=True)
    done(0)
argparse.ArgumentParser.parse_args = parse_args
def child(kind, target, argv):
    sys.argv = [target, *argv]
    try:
        if kind == "cli":
            code = braid.cli.main(argv)
        elif kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
            code = 0
        else:
            runpy.run_path(target, run_name="__main__")
            code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    done(code)
LOADED = tempfile.mktemp()
for line in sys.stdin:
    kind, target, argv = json.loads(line)
    BEFORE = set(sys.modules)
    with tempfile.TemporaryFile("w+") as out:
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            child(kind, target, argv)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        print(json.dumps([os.waitstatus_to_exitcode(status), out.read()]), flush=True)
    if os.path.exists(LOADED):
        for name in json.load(open(LOADED)):
            if name != "__main__" and not name.startswith("__mp"):
                try:
                    importlib.import_module(name)
                except BaseException:
                    pass
        os.unlink(LOADED)
"""


def console_runs(page: str) -> list[tuple[str, list[str]]]:
    """The commands of `page`'s console blocks, continuations joined, each with the output lines shown under it."""
    runs, block, current = [], None, None
    for line in open(os.path.join(ROOT, page)):
        line = line.rstrip("\n")
        fence = re.match(r"\s*```(\w*)", line)
        if fence:
            block = None if block is not None else fence.group(1)
            current = None
            continue
        if block != "console":
            continue
        text = line.strip()
        if current is not None:
            current += " " + text.rstrip("\\").strip()
            if not text.endswith("\\"):
                runs.append((current, []))
                current = None
        elif text.startswith("$ "):
            current = text[2:].rstrip("\\").strip()
            if not text.endswith("\\"):
                runs.append((current, []))
                current = None
        elif runs:
            runs[-1][1].append(line)
    return runs


def console_commands(page: str) -> list[str]:
    """The commands of `page`'s console blocks, continuations joined."""
    return [command for command, _ in console_runs(page)]


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


class _Parser:
    """PARSE_SERVER, started on first use and kept for the module."""
    server = None

    @classmethod
    def run(cls, kind: str, target: str, argv: list[str]) -> tuple[int, str]:
        if cls.server is None or cls.server.poll() is not None:
            cls.server = subprocess.Popen([sys.executable, "-c", PARSE_SERVER], cwd=ROOT, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
        cls.server.stdin.write(json.dumps([kind, target, argv]) + "\n")
        cls.server.stdin.flush()
        line = cls.server.stdout.readline()
        assert line, f"the parse server exited ({cls.server.poll()})"
        code, out = json.loads(line)
        return code, out


@pytest.fixture(scope="module", autouse=True)
def _parser_stops():
    yield
    if _Parser.server is not None:
        _Parser.server.stdin.close()
        _Parser.server.wait(timeout=60)


def _parse_only(kind: str, target: str, argv: list[str]) -> None:
    code, out = _Parser.run(kind, target, argv)
    ok = code == 0 and ("BRAID-ARGS-OK" in out or "usage:" in out)
    assert ok, f"{target} {' '.join(argv)}: exit {code}\n{out[-4000:]}"


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
        assert words[1] in ("serve", "build"), words  # (tests/docs/test_docs.py builds the site)
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


# Client commands a reader runs against `braid serve`: every one of them runs below, as written, against a real
# `braid serve` (its address added), except those that read files of the reader's own (listed here; their flags
# are checked above like every other command's).
CLIENT_COMMANDS = ("run", "loadtest")
READER_FILES = ("--traces",)
CLIENT_CASES = [(page, command, shown) for page in PAGES for command, shown in console_runs(page)
                if any(_program(w) == "braid" and w[1:2] and w[1] in CLIENT_COMMANDS for w in simple_commands(command))
                and not any(flag in command.split() for flag in READER_FILES)]
CLIENT_SNIPPETS = [(page, block) for page in PAGES for block in python_blocks(page) if "AgentServiceStub" in block]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`braid serve` as a reader starts it (the reference model, its key made and left in ~/.braid), in its own
    process with its own HOME; (address, environment for clients on this machine)."""
    from braid.cluster.local import free_port

    home = tmp_path_factory.mktemp("home")
    port = free_port()
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": ROOT}
    env.pop("BRAID_API_KEY", None)
    log = open(home / "serve.log", "w+")
    server = subprocess.Popen([sys.executable, "-m", "braid", "serve", "--port", str(port), "--num-cpus", "2"],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while "Ctrl-C stops" not in (home / "serve.log").read_text():
            assert server.poll() is None and time.monotonic() < deadline, (home / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        assert (home / ".braid" / f"api-key-{port}").exists()
        yield f"127.0.0.1:{port}", env
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    assert not (home / ".braid" / f"api-key-{port}").exists()  # (the key it made goes with the cluster)


def test_braid_serve_makes_a_key_for_this_machine_s_user(served):
    """With no keys given, `braid serve` makes one, prints it once beside the address it listens on and leaves it
    in ~/.braid readable by its user only; a call without it is UNAUTHENTICATED with a message saying what to do,
    a call with it is served. (`braid run` and `braid loadtest` above find it there.)"""
    import stat

    import grpc

    from braid.api.auth import client_metadata
    from braid.protos import agent_pb2 as pb
    from braid.protos import agent_pb2_grpc

    address, env = served
    port = address.rpartition(":")[2]
    path = os.path.join(env["HOME"], ".braid", f"api-key-{port}")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with open(path) as f:
        key = f.read().strip().rpartition(":")[2]
    banner = open(os.path.join(env["HOME"], "serve.log")).read()
    assert banner.count(key) == 1 and f"api key      {key}" in banner
    assert f"on this machine only, 127.0.0.1:{port} (from this machine: 127.0.0.1:{port})" in banner
    with grpc.insecure_channel(address) as channel:
        stub, app = agent_pb2_grpc.AgentServiceStub(channel), (("application", "braid"),)
        with pytest.raises(grpc.RpcError) as err:
            stub.Health(pb.HealthRequest(), metadata=app, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "needs a key" in err.value.details()
        assert stub.Health(pb.HealthRequest(), metadata=app + client_metadata(key), timeout=30).status == "SERVING"


def test_a_second_braid_serve_on_its_port_is_refused_and_leaves_its_key(served):
    """A second `braid serve` on a port a live one serves is refused before anything starts, naming the first; the
    first's key file stays as it was (neither shared nor, when the second stops, deleted), and still opens its API."""
    import grpc

    from braid.api.auth import client_metadata
    from braid.protos import agent_pb2 as pb
    from braid.protos import agent_pb2_grpc

    address, env = served
    port = address.rpartition(":")[2]
    path = os.path.join(env["HOME"], ".braid", f"api-key-{port}")
    before = open(path).read()
    second = subprocess.run([sys.executable, "-m", "braid", "serve", "--port", port, "--num-cpus", "1"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=180)
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"port {port} is taken by another braid serve (pid " in second.stderr and path in second.stderr
    assert open(path).read() == before and os.listdir(os.path.dirname(path)) == [f"api-key-{port}"]
    with grpc.insecure_channel(address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        metadata = (("application", "braid"), *client_metadata(before.strip().rpartition(":")[2]))
        assert stub.Health(pb.HealthRequest(), metadata=metadata, timeout=30).status == "SERVING"


def _shown(line: str) -> str:
    """An output line with what differs from run to run (session and message ids, timings) made a placeholder."""
    line = re.sub(r"session [\w-]+", "session <id>", line)
    line = re.sub(r"answer [0-9a-f]{24}\b", "answer <id>", line)
    return re.sub(r"\d+\.\d+", "<n>", line).rstrip()


def test_every_client_command_is_run():
    pages = {page for page, _, _ in CLIENT_CASES}
    assert {"README.md", "docs/getting-started.md", "docs/workflows.md"} <= pages, pages
    assert len(CLIENT_SNIPPETS) >= 2, CLIENT_SNIPPETS


@pytest.mark.parametrize("page,command,shown", CLIENT_CASES, ids=[f"{p}:{c[:60]}" for p, c, _ in CLIENT_CASES])
def test_client_command_runs_against_braid_serve(served, tmp_path, monkeypatch, capsys, page, command, shown):
    """The command as written, against `braid serve` (the key found where it left it); where the page shows its
    output, that output, line for line in order (ids and timings aside; `...` stands for any lines)."""
    from braid.cli import main

    address, env = served
    monkeypatch.setenv("HOME", env["HOME"])
    monkeypatch.delenv("BRAID_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    for words in simple_commands(command):
        argv = [*words[1:], "--address", address]
        if "--json" in argv:  # (written under this test's folder, not where the page writes it)
            argv[argv.index("--json") + 1] = str(tmp_path / os.path.basename(argv[argv.index("--json") + 1]))
        code = main(argv)
        out = capsys.readouterr()
        assert code == 0, f"{command}: exit {code}\n{out.out[-3000:]}\n{out.err[-3000:]}"
    got = [_shown(line) for line in out.out.splitlines()]
    at = 0
    for line in (_shown(s) for s in shown if s.strip() and s.strip() != "..."):
        assert line in got[at:], f"{page}: `{command}` shows\n  {line}\nbut printed\n{out.out}"
        at = got.index(line, at) + 1


@pytest.mark.parametrize("page,client", CLIENT_SNIPPETS, ids=[p for p, _ in CLIENT_SNIPPETS])
def test_python_client_runs_against_braid_serve(served, monkeypatch, capsys, page, client):
    """The client as written (only its port moved to this test's server), the key read as `braid serve` left it;
    a client of the reference tasks' workflow gets the answer the model gives as text."""
    address, env = served
    monkeypatch.setenv("HOME", env["HOME"])
    monkeypatch.delenv("BRAID_API_KEY", raising=False)
    exec(compile(client.replace("9000", address.rpartition(":")[2]), page, "exec"), {})
    out = capsys.readouterr().out
    assert out.strip(), f"{page}: the client printed nothing"
    if "confidence 8, answer 70" in client:
        assert "confidence 8, answer 70<|end|>" in out, out


def _listening(port: int) -> list[str]:
    """The local addresses of the TCP sockets listening on `port` (from /proc/net/tcp and tcp6)."""
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for row in list(f)[1:]:
                local, state = row.split()[1], row.split()[3]
                address, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:  # (0A: LISTEN)
                    raw = bytes.fromhex(address)
                    # (the kernel writes each 32-bit word in host order: little-endian here)
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, width // 2, 4))
                    found.append(ipaddress.ip_address(words).compressed)
    return found


def test_braid_serve_listens_on_this_machine_only(served):
    """By default the agent API is bound to loopback (`--host` widens it), though Serve's proxy binds every
    interface on its own."""
    address, _ = served
    bound = _listening(int(address.rpartition(":")[2]))
    ips = [ipaddress.ip_address(a) for a in bound]
    assert ips and all((getattr(ip, "ipv4_mapped", None) or ip).is_loopback for ip in ips), bound


def test_hosts_a_user_gives_are_checked_and_bound_as_given():
    from braid.cluster.listen import bind_address, check_host, reach

    assert [bind_address(check_host(h), 9000) for h in ("localhost", "127.0.0.1", "::1", "0.0.0.0", "::")] == \
        ["127.0.0.1:9000", "127.0.0.1:9000", "[::1]:9000", "[::]:9000", "[::]:9000"]
    assert [reach(check_host(h)) for h in ("127.0.0.1", "0.0.0.0", "10.1.2.3")] == \
        ["this machine only", "every interface", "10.1.2.3 only"]
    with pytest.raises(ValueError, match="--host must be an IP address"):
        check_host("my-laptop.example")
