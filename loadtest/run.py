"""`braid loadtest`: drive the gRPC agent API with a workflow mix at a request rate or a fixed concurrency.

Arrivals are a gamma process as in `vllm bench serve` (--burstiness 1 is Poisson) at --request-rate
requests/s, or all at once (the default, rate inf) with --max-concurrency in flight. Prints and writes
the metrics of loadtest.metrics (JSON, and a plot of the TTFT and E2EL distributions).
"""

import argparse
import asyncio
import math
import time
from dataclasses import asdict

import grpc
import numpy as np
from tqdm import tqdm

from braid.api.auth import client_credentials, client_key, client_metadata
from braid.loadtest.metrics import METRICS, RequestRecord, parse_slos, summarize
from braid.loadtest.workload import TRANSPORT_CHOICES, Workload, trace_requests
from braid.protos import agent_pb2 as pb
from braid.protos import agent_pb2_grpc
from braid.results import UNKNOWN, pyplot, write_json_to, written


async def _one(stub, request: pb.WorkflowRequest, metadata, timeout: float, sem, bar,
               live: list[RequestRecord]) -> RequestRecord:
    async with sem:
        rec = RequestRecord(time.perf_counter())
        live.append(rec)
        try:
            async for event in stub.RunWorkflow(request, metadata=metadata, timeout=timeout):
                kind = event.WhichOneof("event")
                if kind == "synthesis_token":
                    now = time.perf_counter()
                    rec.first_token = rec.first_token or now
                    rec.token_times.append(now)
                elif kind == "branch_token":
                    rec.branch_tokens += 1
                elif kind == "branch_failed":
                    rec.lost_branches += 1
                elif kind == "decision":
                    rec.transport = pb.Transport.Name(event.decision.transport).removeprefix("TRANSPORT_").lower()
            rec.end = time.perf_counter()
        except grpc.aio.AioRpcError as e:
            rec.error, rec.end = f"{e.code().name}: {e.details()}", time.perf_counter()
        bar.update()
        return rec


def check_loopback(address: str) -> None:
    """Load and fuzz runs send traffic to this machine only: `address` must be a loopback host:port."""
    import ipaddress

    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"address {address!r} is not on loopback: load and fuzz runs only target this machine "
                         "(127.0.0.1, ::1 or localhost)")


async def run_load(address: str, requests: list[pb.WorkflowRequest], request_rate: float = math.inf,
                   burstiness: float = 1.0, max_concurrency: int = 0, timeout: float = 600, seed: int = 0,
                   application: str = "braid", progress: bool = True, api_key: str | None = None,
                   credentials=None, live: list[RequestRecord] | None = None,
                   gaps: list[float] | None = None) -> tuple[list[RequestRecord], float]:
    """Send every request; returns each one's record and the run's duration (first send to last end). The key
    sent is `api_key`, else $BRAID_API_KEY, else the one `braid serve` made on this machine (api.auth.client_key).
    `live` gets each record as its request starts, for a caller that watches the run (the chaos script's faults
    wait for work under way: a record whose `end` is None)."""
    check_loopback(address)
    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(max_concurrency or len(requests))
    metadata = (("application", application), *client_metadata(client_key(api_key, address), timeout))
    channel = grpc.aio.secure_channel(address, credentials) if credentials else grpc.aio.insecure_channel(address)
    async with channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        with tqdm(total=len(requests), desc="requests", disable=not progress) as bar:
            start, tasks = time.perf_counter(), []
            for i, request in enumerate(requests):
                tasks.append(asyncio.create_task(_one(stub, request, metadata, timeout, sem, bar,
                                                      [] if live is None else live)))
                if gaps is not None and i < len(requests) - 1:  # (a replay at its recorded arrivals)
                    await asyncio.sleep(gaps[i])
                elif math.isfinite(request_rate) and i < len(requests) - 1:
                    await asyncio.sleep(rng.gamma(burstiness, 1 / (request_rate * burstiness)))
            records = await asyncio.gather(*tasks)
    return records, time.perf_counter() - start


def served_model(address: str, application: str = "braid", api_key: str | None = None, credentials=None) -> str:
    """The fingerprint of the weights the agent API at `address` serves (its Health); "unknown" when it says none
    or cannot say (a server of another revision, one that has gone): a result is written whatever it says."""
    metadata = (("application", application), *client_metadata(client_key(api_key, address), 30))
    try:
        with (grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)) as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            return stub.Health(pb.HealthRequest(), metadata=metadata, timeout=30).model_fingerprint or UNKNOWN
    except grpc.RpcError:
        return UNKNOWN


def format_summary(s: dict) -> str:
    lines = [f"completed {s['completed']}, failed {s['failed']}, in {s['duration_s']:.2f} s",
             f"request throughput {s['request_throughput']:.2f} req/s, output {s['output_throughput']:.1f} tok/s, "
             f"all generated {s['generated_token_throughput']:.1f} tok/s"]
    for m in METRICS:
        lines.append(f"{m.upper():>5} ms  mean {s[f'mean_{m}_ms']:8.1f}  median {s[f'median_{m}_ms']:8.1f}  "
                     f"p99 {s[f'p99_{m}_ms']:8.1f}")
    if "request_goodput" in s:
        lines.append(f"goodput {s['request_goodput']:.2f} req/s under {s['slos_ms']} (ms)")
    return "\n".join(lines)


def plot(records: list[RequestRecord], path: str, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    ok = [r for r in records if r.ok]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, (name, values) in zip(axes, [("TTFT", [r.ttft for r in ok]), ("E2EL", [r.e2el for r in ok])]):
        v = np.sort(1e3 * np.asarray(values))
        ax.plot(v, np.arange(1, len(v) + 1) / max(len(v), 1))
        ax.set(xlabel=f"{name}, ms", ylabel="fraction of requests", title=f"{title}: {name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="braid loadtest", description=__doc__.splitlines()[0].strip("`"))
    p.add_argument("--address", default="127.0.0.1:9000", help="the agent API (default: 127.0.0.1:9000)")
    p.add_argument("--application", default="braid", help="Serve application metadata (default: braid)")
    p.add_argument("--api-key", help="the API key to send (default: $BRAID_API_KEY, else the key braid serve made "
                                     "on this machine, ~/.braid/api-key-PORT)")
    p.add_argument("--tls", action="store_true", help="connect over TLS (an Ingress that terminates it)")
    p.add_argument("--ca-cert", help="PEM file of the CA to trust for --tls (default: the system's roots)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests to send (default: 64)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (default: inf, all at once under --max-concurrency)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 is Poisson")
    p.add_argument("--max-concurrency", type=int, default=0, help="requests in flight at most (default: no cap)")
    p.add_argument("--tasks", default="chain,vote,trail", help="task mix (default: chain,vote,trail)")
    p.add_argument("--branches", default="2,4", help="branch counts to draw from (default: 2,4)")
    p.add_argument("--length", default="2,6", help="MIN,MAX size of each branch's work (default: 2,6)")
    p.add_argument("--transports", default="auto", help=f"drawn per request: {', '.join(TRANSPORT_CHOICES)}")
    p.add_argument("--worker-max-tokens", type=int, default=32, help="cap on each worker's reply (default: 32)")
    p.add_argument("--answer-max-tokens", type=int, default=48, help="cap on each answer (default: 48)")
    p.add_argument("--seed", type=int, default=0, help="seeds the requests and the arrivals (default: 0)")
    p.add_argument("--traces", metavar="FILE", nargs="+",
                   help="replay the workflows recorded in these files (braid serve --record) instead of drawing "
                        "reference tasks; --num-prompts of them, from the first again when there are fewer")
    p.add_argument("--recorded-rate", action="store_true",
                   help="with --traces: send them at their recorded arrival times, not at --request-rate")
    p.add_argument("--staircase", choices=["reprefill", "append"], default="",
                   help="send staircase workflows of this variant (needs --transports grpc)")
    p.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    p.add_argument("--timeout", type=float, default=600, help="seconds per request (default: 600)")
    p.add_argument("--json", help="write the config, summary and per-request records here, and a plot beside it")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        lo, hi = (int(x) for x in args.length.split(","))
        workload = Workload(tuple(args.tasks.split(",")), tuple(int(b) for b in args.branches.split(",")), (lo, hi),
                            tuple(args.transports.split(",")), args.worker_max_tokens, args.answer_max_tokens,
                            args.seed, args.staircase)
        slos = parse_slos(args.goodput)
        if args.num_prompts < 1 or args.max_concurrency < 0 or not args.request_rate > 0 or args.burstiness <= 0:
            raise ValueError("--num-prompts >= 1, --max-concurrency >= 0, --request-rate > 0, --burstiness > 0")
        if args.recorded_rate and not args.traces:
            raise ValueError("--recorded-rate replays --traces at their recorded times: give --traces FILE")
        gaps = None
        if args.traces:  # (a malformed line is refused naming the file and line: runtime.traces.TraceError)
            requests, recorded = trace_requests(args.traces, args.num_prompts, args.worker_max_tokens,
                                                args.answer_max_tokens, workload.transports, args.seed)
            gaps = recorded if args.recorded_rate else None
        else:
            requests = workload.requests(args.num_prompts)
    except (ValueError, OSError) as e:
        print(f"braid loadtest: error: {e}")
        return 2
    cpu = time.process_time()
    records, duration = asyncio.run(run_load(args.address, requests, args.request_rate, args.burstiness,
                                             args.max_concurrency, args.timeout, args.seed, args.application,
                                             api_key=args.api_key, gaps=gaps,
                                             credentials=client_credentials(args.tls, args.ca_cert)))
    # this load generator's own CPU over the run, in cores: on a machine it shares with the server, what it took
    summary = {**summarize(records, duration, slos), "client_cores": (time.process_time() - cpu) / duration}
    print(format_summary(summary))
    if args.json:
        # (the server's device and calibration are not known to its client: its Health names its weights)
        model = served_model(args.address, args.application, args.api_key, client_credentials(args.tls, args.ca_cert))
        stem = write_json_to(args.json, {"config": {**vars(args), "workload": asdict(workload)}, "summary": summary,
                                         "requests": [asdict(r) for r in records]},
                             device=UNKNOWN, model=model, calibration=UNKNOWN)
        plot(records, stem + ".png", f"{args.num_prompts} requests")
        print(written(stem + ".json"))
    return 0 if summary["completed"] else 1
