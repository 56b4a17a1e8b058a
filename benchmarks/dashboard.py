"""Braid's Grafana dashboard drawn from a load test, without Grafana: a local cluster serves the load, a real
Prometheus scrapes its metrics export, and every panel's own PromQL (braid.runtime.dashboard.PANELS, the queries the
chart's dashboard runs) is evaluated over the run and plotted in the dashboard's layout.

Needs a prometheus binary (Debian: apt-get install prometheus).
"""

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

from braid.cluster.config import ClusterConfig
from braid.cluster.local import free_port, start_local_cluster
from braid.engine import EngineConfig
from braid.loadtest.metrics import summarize
from braid.loadtest.run import run_load
from braid.loadtest.workload import Workload
from braid.methods.calibration import fingerprints_at
from braid.models import REFERENCE_MODEL
from braid.results import pyplot, write_json
from braid.runtime.dashboard import PANELS, RATE


def start_prometheus(binary: str, target: str, workdir: str, scrape_s: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = os.path.join(workdir, "prometheus.yml")
    with open(config, "w") as f:
        f.write(f"global:\n  scrape_interval: {scrape_s:g}s\nscrape_configs:\n- job_name: ray\n"
                f"  static_configs:\n  - targets: ['{target}']\n")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={workdir}/tsdb",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(60):
        try:
            urllib.request.urlopen(f"{url}/-/ready", timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"prometheus did not start on {url}")


def query_range(url: str, expr: str, start: float, end: float, step_s: float) -> list[dict]:
    args = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step_s})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{args}", timeout=30) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"query failed: {expr}: {body}")
    return body["data"]["result"]


def legend(template: str, labels: dict) -> str:
    out = template
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", v)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=REFERENCE_MODEL, help="checkpoint (default: the reference model)")
    p.add_argument("--prometheus", default=shutil.which("prometheus"), help="prometheus binary (default: on PATH)")
    p.add_argument("--num-prompts", type=int, default=160, help="requests in the load test (default: 160)")
    p.add_argument("--request-rate", type=float, default=1.5, help="Poisson arrivals per second (default: 1.5)")
    p.add_argument("--rate-window", default="20s", help=f"what the panels' {RATE} becomes (default: 20s)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    args = p.parse_args(argv)
    if not args.prometheus:
        p.error("no prometheus binary: pass --prometheus or install it (apt-get install prometheus)")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    metrics_port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        # KV over gRPC is forced for half the requests (auto picks text: the calibration is not verified)
        cluster = start_local_cluster(ClusterConfig(args.model, grpc_port=free_port()), num_cpus=2,
                                      metrics_port=metrics_port, temp_dir=os.path.join(tmp, "ray"))
        prom, prom_url = start_prometheus(args.prometheus, f"127.0.0.1:{metrics_port}", tmp, 2)
        try:
            workload = Workload(tasks=("chain", "vote", "trail"), branches=(2, 4), transports=("text", "grpc"),
                                worker_max_tokens=32, answer_max_tokens=48, seed=0)
            start = time.time()
            records, duration = asyncio.run(run_load(cluster.address, workload.requests(args.num_prompts),
                                                     args.request_rate, seed=0))
            time.sleep(20)  # the replicas report metrics every few seconds; let the last ones land
            end = time.time()
            panels = []
            for panel in PANELS:
                series = []
                for expr, template in panel.queries:
                    for s in query_range(prom_url, expr.replace(RATE, args.rate_window), start, end, 2):
                        points = [(float(t) - start, float(v)) for t, v in s["values"] if v not in ("NaN", "+Inf")]
                        series.append({"legend": legend(template, s["metric"]), "points": points})
                panels.append({"title": panel.title, "unit": panel.unit, "series": series})
        finally:
            prom.terminate()
            cluster.stop()
    summary = summarize(records, duration, {})
    result = {"num_prompts": args.num_prompts, "request_rate": args.request_rate, "rate_window": args.rate_window,
              "loadtest": summary, "panels": panels}
    stem = write_json(args.out, "dashboard_cpu", result, device="cpu", **fingerprints_at(EngineConfig(args.model)))
    print(f"{summary['completed']} of {args.num_prompts} requests in {duration:.0f}s; "
          f"{sum(bool(p['series']) for p in panels)} of {len(panels)} panels have data")
    plt = pyplot()
    if plt is not None:
        rows = (len(panels) + 1) // 2
        fig, axes = plt.subplots(rows, 2, figsize=(13, 2.6 * rows), sharex=True)
        for ax, panel in zip(axes.flat, panels):
            for s in panel["series"]:
                if s["points"]:
                    ax.plot(*zip(*s["points"]), label=s["legend"])
            ax.set_title(f"{panel['title']} [{panel['unit']}]", fontsize=9)
            ax.tick_params(labelsize=7)
            if panel["series"]:
                ax.legend(fontsize=6, loc="upper left")
        for ax in axes.flat[len(panels):]:
            ax.axis("off")
        for ax in axes[-1]:
            ax.set_xlabel("seconds into the load test")
        fig.suptitle(f"Braid dashboard panels from Prometheus over a load test ({args.num_prompts} requests, "
                     f"{args.request_rate:g}/s, text and KV over gRPC)", fontsize=10)
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=110)
        print(f"wrote {stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
