"""Serving throughput and latency under load: the engine one call at a time against the scheduler.

Each runs side by side in a server process of its own, as a server has it (one engine per process: see
engine.threads), behind its own in-process agent API (colocated: one engine for workers and synthesis) on the
same model; `braid loadtest`, in its own process as a client would be, drives each at every concurrency in turn,
for each transport asked for (text: branches re-prefilled; local: their KV reused in place). "serial" is the
engine with max_running_requests=1: one engine request at a time, as before the scheduler. `--against REV` adds a
third server, another git revision's engine as it was (its own defaults; benchmarks.revision), e.g. the engine the
serving-engine issue started from. `--device cuda` serves on a GPU (the device run's `serving` step, on a random
8B-shape checkpoint), and `--flex` adds the scheduler with attention read in place (EngineConfig.attention flex).
Prints the ratios and writes JSON and a plot.
"""

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
from contextlib import nullcontext

from braid.cluster.inprocess import start_in_process
from braid.engine import Engine, EngineConfig
from braid.models import REFERENCE_MODEL

# (a server process may import another revision's braid (--against): only what every revision has, up here)
try:
    from braid.runtime.directory import Directory, EmbeddedRedis
except ImportError:  # (a revision from before the runtime room)
    from braid.api.directory import Directory, EmbeddedRedis

from braid.results import pyplot, write_json

ENGINES = {"serial": {"max_running_requests": 1}, "scheduler": {}}
APART = {"apart": {"mix_adapters": False}}  # --adapters-apart: the scheduler, base and LoRA calls taking turns
FLEX = {"flex": {"attention": "flex"}}  # --flex: the scheduler, its attention reading the KV pool in place
BEFORE = "before"  # --against REV: that revision's engine with its own defaults


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=REFERENCE_MODEL, help="checkpoint (default: the reference model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--requests-per-level", type=int, default=2, help="requests = this x concurrency (at least 8)")
    p.add_argument("--worker-max-tokens", type=int, default=32)
    p.add_argument("--answer-max-tokens", type=int, default=48)
    p.add_argument("--transports", nargs="+", default=["text", "local"], choices=["text", "local"])
    p.add_argument("--adapters-apart", action="store_true",
                   help="also run the scheduler with base and LoRA calls in forwards of their own, taking turns "
                        "(EngineConfig.mix_adapters false), to compare with mixing them")
    p.add_argument("--no-serial", action="store_true",
                   help="leave out the serial engine (one call at a time: minutes a level on a GPU at high load)")
    p.add_argument("--flex", action="store_true", help="also run the scheduler with attention flex (FlexAttention "
                   "over the KV pool in place) beside the others")
    p.add_argument("--device", default="cpu", help="where the servers' engines run: cpu (float32) or cuda (bfloat16)")
    p.add_argument("--kv-gib", type=float, default=0.0,
                   help="each engine's work KV in GiB (0: the engine's default; give one on a GPU, where the engines "
                        "share its memory)")
    p.add_argument("--against", metavar="REV",
                   help="also run this git revision's engine, as it was (its defaults), side by side with the others")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    # (a server process: this engine)
    p.add_argument("--serve", choices=[*ENGINES, *APART, *FLEX, BEFORE], help=argparse.SUPPRESS)
    p.add_argument("--redis", help=argparse.SUPPRESS)  # (its directory)
    return p.parse_args(argv)


class Sampler:
    """Store bytes and work-KV reserved by the scheduler, polled while a level runs (their maxima)."""

    def __init__(self, engine: Engine):
        self.engine, self.stop, self.max_store, self.max_reserved, self.max_running = engine, threading.Event(), 0, 0, 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        scheduler = getattr(self.engine, "scheduler", None)  # (an engine from before the scheduler has none)
        while not self.stop.wait(0.02):
            self.max_store = max(self.max_store, self.engine.store.used_bytes)
            if hasattr(scheduler, "load"):
                load = scheduler.load
                self.max_reserved = max(self.max_reserved, load["reserved_bytes"])
                self.max_running = max(self.max_running, load["running"])


class Server:
    """A server process (`--serve NAME`): one engine behind an in-process agent API. It answers `start` (a
    level begins: take note of its counters, sample its memory) and `stop` (its counters since, as JSON)."""

    def __init__(self, name: str, args, redis_url: str, log_dir: str, pythonpath: str | None = None):
        self.name = name
        self.log = os.path.join(log_dir, f"{name}.log")  # (its stderr: what to read when it fails)
        serve = BEFORE if pythonpath else name
        env = dict(os.environ, PYTHONPATH=pythonpath) if pythonpath else None  # (that revision's braid)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", serve, "--model",
                                          args.model, "--redis", redis_url, "--device", args.device,
                                          "--kv-gib", str(args.kv_gib)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        self.port = int(self._reply("PORT"))
        self.kv_bytes_per_token = int(self._reply("KV"))

    def _reply(self, kind: str) -> str:
        for line in self.proc.stdout:  # (its only output on stdout is these lines)
            if line.startswith(kind + " "):
                return line[len(kind) + 1:].strip()
        with open(self.log) as f:
            tail = f.read()[-2000:]
        raise RuntimeError(f"server {self.name} exited (code {self.proc.wait()}) before its {kind} line:\n{tail}")

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self._reply("DONE"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # (it exits at the end of its input)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve(args) -> int:
    """(In a server process.) One engine and its API; counters per level, asked for on stdin. Another revision's
    engine (--against) may lack some counters (one from before the scheduler has none): they come back as zeros."""
    kv = {"kv_budget_bytes": int(args.kv_gib * (1 << 30))} if args.kv_gib else {}  # (an engine of old has no budget)
    engine = _engine(EngineConfig(args.model, device=args.device, dtype="float32" if args.device == "cpu" else "auto",
                                  **kv, **{**ENGINES, **APART, **FLEX, BEFORE: {}}[args.serve]))
    server = start_in_process(engine, Directory.connect(args.redis))
    print(f"PORT {server.port}", flush=True)
    print(f"KV {getattr(getattr(engine, 'scheduler', None), 'slot_bytes', 0)}", flush=True)  # (KV bytes per token)
    sampler, before, counters = None, None, None
    try:
        for command in sys.stdin:
            command = command.strip()
            if command == "start":
                counters = _counters(engine)
                sampler, before = Sampler(engine), resource.getrusage(resource.RUSAGE_SELF)
                sampler.thread.start()
                out = {}
            elif command == "stop":
                sampler.stop.set()
                d = {name: now - counters[name] for name, now in _counters(engine).items()}
                out = {"forwards": d["steps"], "stepped": d["requests_stepped"], "busy_s": d["busy_s"],
                       "rows": d["rows_stepped"],
                       "cpu_s": _cpu(resource.getrusage(resource.RUSAGE_SELF)) - _cpu(before),
                       "max_running": sampler.max_running, "max_store_bytes": sampler.max_store,
                       "max_work_kv_bytes": sampler.max_reserved}
            else:
                raise ValueError(f"unknown command {command!r}")
            print("DONE " + json.dumps(out), flush=True)
    finally:
        server.stop()
    return 0


def _engine(config: EngineConfig) -> Engine:
    """The engine with its calibration attached, as the synthesizer deployment makes it."""
    try:
        from braid.methods.calibration import load_engine
    except ImportError:  # (a revision from before the methods room, whose engine attaches it itself)
        return Engine(config)
    return load_engine(config)


def _counters(engine: Engine) -> dict[str, float]:
    """The scheduler's forward counters so far (each 0 where the engine's revision has none)."""
    scheduler = getattr(engine, "scheduler", None)
    got = {name: getattr(scheduler, name, 0) for name in ("steps", "busy_s", "rows_stepped")}
    # (requests over all forwards; a revision from before the name counted them as groups_stepped)
    got["requests_stepped"] = getattr(scheduler, "requests_stepped", getattr(scheduler, "groups_stepped", 0))
    return got


def level(server: Server, transport: str, concurrency: int, n: int, args) -> dict:
    """One load level against one server, the client in its own process; the server's memory sampled."""
    server.ask("start")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "level.json")
        subprocess.run([sys.executable, "-m", "braid.cli", "loadtest", "--address", f"127.0.0.1:{server.port}",
                        "--num-prompts", str(n), "--max-concurrency", str(concurrency), "--transports", transport,
                        "--worker-max-tokens", str(args.worker_max_tokens), "--answer-max-tokens",
                        str(args.answer_max_tokens), "--seed", str(concurrency), "--json", out],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out) as f:
            s = json.load(f)["summary"]
    c = server.ask("stop")
    name = server.name
    row = {"engine": name, "transport": transport, "concurrency": concurrency, "requests": n, **s,
           "max_store_bytes": c["max_store_bytes"],
           # cores busy (of os.cpu_count()) over the run: the server process's, and the load generator's (its
           # summary's client_cores), which share the cores
           "server_cores": c["cpu_s"] / s["duration_s"]}
    forwards = ""
    if c["forwards"]:  # (an engine from before the scheduler (--against) counts none)
        row.update(calls_per_forward=c["stepped"] / c["forwards"], ms_per_forward=1e3 * c["busy_s"] / c["forwards"],
                   tokens_per_forward=c["rows"] / c["forwards"], model_busy=c["busy_s"] / s["duration_s"],
                   max_running_calls=c["max_running"], max_work_kv_bytes=c["max_work_kv_bytes"])
        forwards = (f"{row['calls_per_forward']:.1f} calls, {row['tokens_per_forward']:.0f} tokens per forward of "
                    f"{row['ms_per_forward']:.1f} ms, model busy {100 * row['model_busy']:.0f}%, ")
    print(f"{name:>9} {transport:>5} c={concurrency:<3} {s['completed']:>3} ok {s['failed']} failed  "
          f"{s['request_throughput']:6.2f} wf/s  {s['generated_token_throughput']:7.1f} tok/s  "
          f"TTFT p50 {s['median_ttft_ms']:7.1f} p99 {s['p99_ttft_ms']:7.1f} ms  "
          f"TPOT p50 {s['median_tpot_ms']:6.1f} p99 {s['p99_tpot_ms']:6.1f} ms  {forwards}"
          f"cores: server {row['server_cores']:.2f}, load generator {s['client_cores']:.2f}", flush=True)
    return row


def _cpu(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve(args)
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (benchmarks.revision)
    from benchmarks.revision import labels, sides
    from braid.loadtest.run import run_load
    from braid.loadtest.workload import Workload

    this, rev = labels(args.against) if args.against else (None, None)
    servers, rows, redis = {}, [], None
    with tempfile.TemporaryDirectory(prefix="braid-serving-") as logs, \
            sides(args.against, logs) if args.against else nullcontext({}) as paths:
        try:
            redis = EmbeddedRedis()
            wanted = {**ENGINES, **(APART if args.adapters_apart else {}), **(FLEX if args.flex else {})}
            for name in wanted:
                if name == "serial" and args.no_serial:
                    continue
                servers[name] = Server(name, args, redis.url, logs)
            if rev:
                servers[BEFORE] = Server(BEFORE, args, redis.url, logs, pythonpath=list(paths.values())[1])
            workload = Workload(worker_max_tokens=args.worker_max_tokens, answer_max_tokens=args.answer_max_tokens)
            warm = workload.requests(4)
            for server in servers.values():  # warm-up, not measured
                asyncio.run(run_load(f"127.0.0.1:{server.port}", warm, max_concurrency=4, progress=False))
            turn = 0
            for transport in args.transports:
                for c in args.concurrency:
                    n = max(8, args.requests_per_level * c)
                    order = list(servers.values())
                    for server in order[turn % len(order):] + order[:turn % len(order)]:  # (each first in turn)
                        rows.append(level(server, transport, c, n, args))
                    turn += 1
            kv_per_token = servers["scheduler"].kv_bytes_per_token
            for row in rows:
                if row["engine"] == BEFORE:
                    row["revision"] = rev
        finally:  # (before the revision's checkout goes)
            for server in servers.values():
                server.stop()
            if redis is not None:
                redis.stop()
    ratios = []
    for transport in args.transports:
        for c in args.concurrency:
            row = {r["engine"]: r for r in rows if r["concurrency"] == c and r["transport"] == transport}
            r = {"transport": transport, "concurrency": c}
            ratios.append(r)
            if "serial" in row:
                r.update(compare(row["scheduler"], row["serial"]))
                print(f"{transport:>5} c={c:<3} scheduler/serial: token throughput {r['token_throughput_x']:.2f}x, "
                      f"workflows {r['workflow_throughput_x']:.2f}x, median TTFT {r['median_ttft_ratio']:.2f}x, "
                      f"p99 TTFT {r['p99_ttft_ratio']:.2f}x")
            # the scheduler against that revision's engine; with attention flex against the default (sdpa)
            for key, new, old, label in (("against", "scheduler", BEFORE, f"scheduler/{rev}"),
                                         ("flex", "flex", "scheduler", "attention flex/sdpa")):
                if new in row and old in row:
                    r[key] = x = compare(row[new], row[old])
                    print(f"{'':>5} c={c:<3} {label}: token throughput {x['token_throughput_x']:.2f}x, "
                          f"workflows {x['workflow_throughput_x']:.2f}x, median TTFT {x['median_ttft_ratio']:.2f}x, "
                          f"p99 TTFT {x['p99_ttft_ratio']:.2f}x")
            if "apart" in row and "serial" in row:
                r["mixed_vs_apart_token_throughput_x"] = compare(row["scheduler"], row["apart"])["token_throughput_x"]
                r["apart_vs_serial_token_throughput_x"] = compare(row["apart"], row["serial"])["token_throughput_x"]
                print(f"{'':>5} c={c:<3} adapters mixed/apart: token throughput "
                      f"{r['mixed_vs_apart_token_throughput_x']:.2f}x (apart/serial "
                      f"{r['apart_vs_serial_token_throughput_x']:.2f}x)")
    from braid.results import device_name  # (not up top: a server of another revision imports this file)

    kind = "cpu" if args.device == "cpu" else "cuda"
    result = {"model": args.model, "device": device_name(args.device), "kv_bytes_per_token": kv_per_token,
              "config": vars(args),
              "this": this, "against": rev, "workload": workload.__dict__, "rows": rows, "ratios": ratios}
    from braid.methods.calibration import fingerprints_at
    from braid.results import written  # (this tree's: a server process under --against never reaches here)

    stem = write_json(args.out, f"serving_{kind}" + ("_against" if rev else ""), result, device=args.device,
                      **fingerprints_at(EngineConfig(args.model)))
    plot(rows, stem + ".png")
    print(written(stem + ".json"))
    return 0


def compare(new: dict, old: dict) -> dict:
    """Level `new` against level `old` (one transport and concurrency): throughput ratios, new over old, and TTFT
    ratios, new over old (below 1: new answers sooner)."""
    return {"token_throughput_x": new["generated_token_throughput"] / old["generated_token_throughput"],
            "workflow_throughput_x": new["request_throughput"] / old["request_throughput"],
            "median_ttft_ratio": new["median_ttft_ms"] / old["median_ttft_ms"],
            "p99_ttft_ratio": new["p99_ttft_ms"] / old["p99_ttft_ms"]}


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    transports = list(dict.fromkeys(r["transport"] for r in rows))
    fig, axes = plt.subplots(len(transports), 3, figsize=(13, 3.4 * len(transports)), squeeze=False)
    for axrow, transport in zip(axes, transports):
        for name in dict.fromkeys(r["engine"] for r in rows):
            sel = sorted((r for r in rows if r["engine"] == name and r["transport"] == transport),
                         key=lambda r: r["concurrency"])
            c = [r["concurrency"] for r in sel]
            name = f"{name} ({sel[0]['revision']})" if "revision" in sel[0] else name
            axrow[0].plot(c, [r["generated_token_throughput"] for r in sel], marker="o", label=name)
            for ax, metric in ((axrow[1], "ttft"), (axrow[2], "tpot")):
                ax.plot(c, [r[f"median_{metric}_ms"] for r in sel], marker="o", label=f"{name} p50")
                ax.plot(c, [r[f"p99_{metric}_ms"] for r in sel], marker="x", ls="--", label=f"{name} p99")
        axrow[0].set(xscale="log", xlabel="concurrent workflows", ylabel="generated tokens/s",
                     title=f"throughput ({transport})")
        for ax, metric in ((axrow[1], "TTFT"), (axrow[2], "TPOT")):
            ax.set(xscale="log", yscale="log", xlabel="concurrent workflows", ylabel="ms",
                   title=f"{metric} ({transport})")
        for ax in axrow:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
