"""Faults under load: Redis restarted, or a Worker replica killed, while workflows run; none may hang or be lost.

`python -m braid.loadtest.chaos redis-restart` serves the reference model in process on an embedded Redis,
sends workflows at a fixed concurrency and, once they are under way, stops Redis (losing everything it
held: no persistence) and starts it again on the same port. It passes when workflows were under way when Redis
stopped (started, not yet ended) and every workflow completed.

`python -m braid.loadtest.chaos kill-worker` starts a local Ray cluster (two Worker replicas), sends
workflows and kills one Worker replica while they run. It passes when workflows were under way at the kill,
none hung, each either completed or failed with UNAVAILABLE (its branches were on the killed replica), and a
new workflow completes afterwards without anyone restarting anything. With `--graphs`, the load is RunGraph
debates (MADpar, whose waves decode on the Worker replicas) instead, under the same bar, and afterwards a new
graph must complete too.

`python -m braid.loadtest.chaos client-leaves` starts a local Ray cluster and, one workflow at a time, stops
each mid-stream from the client's side, three ways: the client cancels the call; its gRPC deadline passes;
its deadline passes where Braid's clients also send it as metadata (`braid-timeout-ms`). Each time it checks
that the Worker and Synthesizer replicas are idle within `--grace` seconds. It passes when every workflow
stopped, every way (the first two rely on Serve's gRPC proxy passing the client's cancel on, which
cluster.grpc_proxy makes sure of).

Traffic goes to loopback only. Writes JSON.
"""

import argparse
import asyncio
import threading
import time
from collections import Counter

import grpc

from braid.loadtest.run import run_load
from braid.loadtest.workload import Workload
from braid.protos import agent_pb2_grpc


def _load_in_background(address: str, requests, concurrency: int, timeout: float):
    """Run the load on its own thread; returns (thread, result dict filled with 'records' when done, and with
    'live': each record as its request starts)."""
    out: dict = {"live": []}

    def go():
        out["records"], out["seconds"] = asyncio.run(run_load(address, requests, max_concurrency=concurrency,
                                                              timeout=timeout, progress=False, live=out["live"]))

    thread = threading.Thread(target=go, daemon=True, name="chaos-load")
    thread.start()
    return thread, out


def _under_way(thread, out: dict, after_s: float, within_s: float = 60.0) -> None:
    """Waits `after_s` into the load, then until a workflow is under way (started, not ended), so that the fault
    meets work; gives up when the load has ended (a fault then meets nothing: the run fails) or after `within_s`."""
    time.sleep(after_s)
    deadline = time.monotonic() + within_s
    while thread.is_alive() and time.monotonic() < deadline and not any(r.end is None for r in list(out["live"])):
        time.sleep(0.005)


def _outcome(record) -> str:
    """OK, the status it failed with, or INCOMPLETE (its stream ended without an answer)."""
    return "OK" if record.ok else (record.error.split(":", 1)[0] or "INCOMPLETE")


def _outcomes(records) -> dict:
    codes = Counter(_outcome(r) for r in records)
    return {"workflows": len(records), "outcomes": dict(codes), "hung": codes["DEADLINE_EXCEEDED"],
            "completed_with_lost_branches": sum(r.ok and r.lost_branches > 0 for r in records),
            "lost_branches": sum(r.lost_branches for r in records),
            "errors": sorted({r.error for r in records if r.error})[:20]}


def _hit(records, at: float) -> dict:
    """What the fault at `at` met: how many workflows were under way (started before it, not ended by then;
    one that never ended counts), and how each of those ended. A run where it met none tested nothing."""
    hit = [r for r in records if r.start < at and (r.end is None or r.end > at)]
    return {"in_flight_at_fault": len(hit), "in_flight_outcomes": dict(Counter(_outcome(r) for r in hit))}


def recovers(address: str, within_s: float = 90.0, metadata=(("application", "braid"),)) -> float | None:
    """Seconds until a fresh workflow completes at `address` (None: not within `within_s`)."""
    start = time.monotonic()
    request = Workload(transports=("text",), worker_max_tokens=4, answer_max_tokens=4).requests(1)[0]
    with grpc.insecure_channel(address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        while time.monotonic() - start < within_s:
            try:
                events = list(stub.RunWorkflow(request, metadata=metadata, timeout=60))
                if events and events[-1].HasField("done"):
                    return time.monotonic() - start
            except grpc.RpcError:
                pass
            time.sleep(1.0)
    return None


def redis_restart_under_load(address: str, redis_server, workflows: int = 40, concurrency: int = 8,
                             after_s: float = 2.0, down_s: float = 1.0, timeout: float = 300.0,
                             workload: Workload = Workload()) -> dict:
    """Stop the agent API's Redis `after_s` into the load (once a workflow is under way) for `down_s`, then start
    it again (empty)."""
    thread, out = _load_in_background(address, workload.requests(workflows), concurrency, timeout)
    _under_way(thread, out, after_s)
    redis_server.stop()
    stopped = time.perf_counter()  # (records are timed by perf_counter)
    time.sleep(down_s)
    redis_server.start()
    thread.join(timeout + 60)
    records = out.get("records", [])
    result = {**_outcomes(records), "after_s": after_s, "down_s": down_s, **_hit(records, stopped),
              "recovered_s": recovers(address, metadata=())}
    result["passed"] = (not thread.is_alive() and result["outcomes"].get("OK", 0) == workflows
                        and result["in_flight_at_fault"] > 0 and result["recovered_s"] is not None)
    return result


def kill_worker_under_load(address: str, workflows: int = 20, concurrency: int = 20, after_s: float = 2.0,
                           timeout: float = 300.0, workload: Workload = Workload(), recover_within_s: float = 120.0,
                           metadata=(("application", "braid"),)) -> dict:
    """Kill one Worker replica of the Serve app in this process's Ray `after_s` into the load (once a workflow is
    under way)."""
    import ray

    thread, out = _load_in_background(address, workload.requests(workflows), concurrency, timeout)
    _under_way(thread, out, after_s)
    workers = [a for a in ray.util.list_named_actors(all_namespaces=True) if "Worker" in a["name"]]
    if not workers:
        raise RuntimeError("no Worker replica to kill: is the cluster colocated?")
    ray.kill(ray.get_actor(workers[0]["name"], namespace=workers[0]["namespace"]), no_restart=False)
    killed_at, killed_clock = time.monotonic(), time.perf_counter()  # (records are timed by perf_counter)
    thread.join(timeout + 60)
    back = recovers(address, recover_within_s, metadata)
    records = out.get("records", [])
    result = {**_outcomes(records), "replicas_before": len(workers), "after_s": after_s,
              **_hit(records, killed_clock),
              "recovered_s": None if back is None else time.monotonic() - killed_at}  # (from the kill)
    other = {k: n for k, n in result["outcomes"].items() if k not in ("OK", "UNAVAILABLE")}
    result["passed"] = (not thread.is_alive() and len(records) == workflows and not other
                        and result["in_flight_at_fault"] > 0 and result["recovered_s"] is not None)
    return result


def debate(max_tokens: int = 24):
    """A MADpar debate (methods.dag.presets) as a RunGraph request: 3 agents x 2 rounds and, with random or
    reference weights alike, `max_tokens` per reply."""
    from braid.engine import SamplingParams
    from braid.methods.dag.presets import mad_par
    from braid.runtime.convert import graph_request

    return graph_request(mad_par("which city is larger?", agents=3, rounds=2,
                                 sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


def kill_worker_under_graphs(address: str, graphs: int = 20, after_s: float = 3.0, timeout: float = 120.0,
                             recover_within_s: float = 120.0, max_tokens: int = 24,
                             metadata=(("application", "braid"),)) -> dict:
    """`graphs` debates at once; one Worker replica of the Serve app in this process's Ray killed `after_s` in.
    Each debate's outcome is its status (DEADLINE_EXCEEDED: it hung past `timeout`)."""
    import ray

    ended: list[tuple[float, float, str]] = []  # (start, end, outcome) per debate, perf_counter
    lock = threading.Lock()
    request = debate(max_tokens)

    def one():
        start = time.perf_counter()
        try:
            with grpc.insecure_channel(address) as channel:
                events = list(agent_pb2_grpc.AgentServiceStub(channel).RunGraph(request, metadata=metadata,
                                                                                   timeout=timeout))
            code = "OK" if events and events[-1].HasField("done") else "INCOMPLETE"
        except grpc.RpcError as e:
            code = e.code().name
        with lock:
            ended.append((start, time.perf_counter(), code))

    threads = [threading.Thread(target=one, daemon=True, name="chaos-graph") for _ in range(graphs)]
    for t in threads:
        t.start()
    time.sleep(after_s)
    workers = [a for a in ray.util.list_named_actors(all_namespaces=True) if "Worker" in a["name"]]
    if not workers:
        raise RuntimeError("no Worker replica to kill: is the cluster colocated?")
    ray.kill(ray.get_actor(workers[0]["name"], namespace=workers[0]["namespace"]), no_restart=False)
    killed_at, killed_clock = time.monotonic(), time.perf_counter()
    for t in threads:
        t.join(timeout + 60)
    with lock:
        outcomes = [code for *_, code in ended]
        hung = sum(t.is_alive() for t in threads)  # (never ended: in flight at the kill, and counted as such)
        hit = [code for start, end, code in ended if start < killed_clock < end] + ["HUNG"] * hung
    back = recovers(address, recover_within_s, metadata)
    recovered = None if back is None else time.monotonic() - killed_at  # (from the kill)
    graph_back = None
    if back is not None:  # and a new debate, whose waves need the Worker replicas again
        with grpc.insecure_channel(address) as channel:
            try:
                events = list(agent_pb2_grpc.AgentServiceStub(channel).RunGraph(request, metadata=metadata,
                                                                                   timeout=timeout))
                graph_back = time.monotonic() - killed_at if events[-1].HasField("done") else None
            except grpc.RpcError:
                pass
    codes = Counter(outcomes)
    result = {"workflows": graphs, "outcomes": dict(codes), "hung": codes["DEADLINE_EXCEEDED"] + hung,
              "in_flight_at_fault": len(hit), "in_flight_outcomes": dict(Counter(hit)),
              "replicas_before": len(workers), "after_s": after_s, "completed_with_lost_branches": 0,
              "lost_branches": 0, "recovered_s": recovered, "graph_recovered_s": graph_back}
    other = {k: n for k, n in codes.items() if k not in ("OK", "UNAVAILABLE")}
    result["passed"] = (not result["hung"] and not other and len(hit) > 0 and graph_back is not None)
    return result


LEAVES = ("cancel", "grpc-deadline", "metadata-deadline")


def clients_leave(address: str, per_way: int = 20, grace_s: float = 3.0, seed: int = 0, wait_out_s: float = 300.0,
                  deadlines: tuple[float, float] = (0.5, 2.0), metadata=(("application", "braid"),)) -> dict:
    """Per way a client can leave (LEAVES), `per_way` workflows stopped mid-stream one after another: how many
    left every replica idle (nothing waiting, running or reserved) within `grace_s`, and how many were still
    running (then waited out, at most `wait_out_s`, before the next). A workflow counts only if its workers
    were decoding when it left and it ended as the client left it (CANCELLED or DEADLINE_EXCEEDED); the
    deadline ways draw their deadline from `deadlines` (seconds), which must end before 2 x 1500 worker tokens
    do. Uses the Serve app of this process's Ray."""
    import random

    from ray import serve

    from braid.api.auth import client_metadata
    from braid.protos import agent_pb2 as pb

    roles = [serve.get_deployment_handle(name, app_name="braid") for name in ("Worker", "Synthesizer")]

    def busy() -> bool:
        return any(r.load.remote().result() != {"waiting": 0, "running": 0, "reserved_bytes": 0} for r in roles)

    rng, rows, statuses, examples = random.Random(seed), {}, Counter(), {}
    expected = {"cancel": "CANCELLED", "grpc-deadline": "DEADLINE_EXCEEDED", "metadata-deadline": "DEADLINE_EXCEEDED"}
    with grpc.insecure_channel(address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        for way in LEAVES:
            row = {"workflows": 0, "left_before_decoding": 0, "ended_otherwise": 0, "stopped": 0, "still_running": 0,
                   "hung": 0}
            settle = []
            for _ in range(per_way):
                deadline = rng.uniform(*deadlines)
                call = stub.RunWorkflow(pb.WorkflowRequest(
                    task="t", branch_prompts=["a", "b"], synthesis_prompt="s", transport=pb.TRANSPORT_GRPC,
                    worker_sampling=pb.Sampling(max_tokens=1500, ignore_eos=True),
                    synthesis_sampling=pb.Sampling(max_tokens=6, ignore_eos=True)),
                    metadata=metadata + (client_metadata(None, deadline) if way == "metadata-deadline" else ()),
                    # (the metadata way: the server's deadline fires, the client's own is far later)
                    timeout={"cancel": 120, "grpc-deadline": deadline}.get(way, deadline + 60))
                leave_at = rng.randint(3, 60)  # (events in: the workers are decoding)
                decoding, status = False, "OK"
                try:
                    for i, event in enumerate(call):
                        decoding = decoding or event.HasField("branch_token")
                        if way == "cancel" and i == leave_at:
                            call.cancel()
                except grpc.RpcError as e:
                    status = e.code().name
                    statuses[status] += 1
                    examples.setdefault(status, (e.details() or "")[:160])
                if not decoding:  # (it left before any worker decoded: not the case measured)
                    row["left_before_decoding"] += 1
                    continue
                if status != expected[way]:  # (it finished, or failed, before the client left)
                    row["ended_otherwise"] += 1
                    continue
                row["workflows"] += 1
                left = time.monotonic()
                while busy() and time.monotonic() - left < grace_s:
                    time.sleep(0.05)
                if not busy():
                    row["stopped"] += 1
                    settle.append(time.monotonic() - left)
                    continue
                row["still_running"] += 1
                while busy() and time.monotonic() - left < wait_out_s:  # (it decodes on to max_tokens: wait it
                    time.sleep(0.5)                                      # out, so the next starts clean)
                row["hung"] += busy()
            rows[way] = {**row, "max_stop_s": max(settle, default=None)}
    return {"ways": rows, "grace_s": grace_s, "statuses": dict(statuses), "status_examples": examples,
            "passed": all(r["workflows"] > 0 and r["stopped"] == r["workflows"] for r in rows.values())}


def main(argv=None) -> int:
    from braid.engine import EngineConfig
    from braid.methods.calibration import fingerprints_at
    from braid.models import REFERENCE_MODEL
    from braid.results import write_json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("fault", choices=("redis-restart", "kill-worker", "client-leaves"), help="what to break")
    p.add_argument("--model", default=REFERENCE_MODEL, help="checkpoint to serve (default: the reference model)")
    p.add_argument("--workflows", type=int, default=None, help="workflows to send (default: 40 for "
                                                               "redis-restart, 20 for kill-worker, 20 per way "
                                                               "for client-leaves)")
    p.add_argument("--concurrency", type=int, default=None, help="workflows in flight (default: 8 for "
                                                                 "redis-restart, all of them for kill-worker)")
    p.add_argument("--after", type=float, default=None, help="seconds into the load to break it (default: 2 for "
                                                             "redis-restart, 3 for kill-worker)")
    p.add_argument("--down", type=float, default=1.0, help="redis-restart: seconds Redis stays down (default: 1)")
    p.add_argument("--staircase", choices=["reprefill", "append"], default=None,
                   help="kill-worker: staircase workflows (KV over gRPC), which answer on without a lost branch")
    p.add_argument("--graphs", action="store_true",
                   help="kill-worker: RunGraph debates (their waves on the Worker replicas) instead of workflows")
    p.add_argument("--grace", type=float, default=3.0,
                   help="client-leaves: seconds the replicas have to become idle (default: 3)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON")
    args = p.parse_args(argv)
    workflows = args.workflows or (40 if args.fault == "redis-restart" else 20)
    concurrency = args.concurrency or (8 if args.fault == "redis-restart" else workflows)
    after = args.after if args.after is not None else (2.0 if args.fault == "redis-restart" else 3.0)
    if workflows < 1 or concurrency < 1 or after < 0 or args.down < 0:
        p.error("--workflows and --concurrency must be >= 1, --after and --down >= 0")
    if (args.staircase or args.graphs) and args.fault != "kill-worker":
        p.error("--staircase and --graphs go with kill-worker")
    if args.staircase and args.graphs:
        p.error("--staircase is for workflows; --graphs sends debates")
    if args.grace <= 0:
        p.error(f"--grace must be > 0, got {args.grace}")
    if args.fault == "client-leaves":
        return _clients_leave_main(args)
    workload = Workload()
    if args.fault == "kill-worker":  # (long enough that the workers are busy at the kill)
        workload = Workload(branches=(4,), length=(8, 12), transports=("grpc",) if args.staircase else ("text", "grpc"),
                            staircase=args.staircase or "")
    if args.fault == "redis-restart":
        from braid.cluster.inprocess import start_in_process
        from braid.methods.calibration import load_engine
        from braid.runtime.directory import Directory, EmbeddedRedis

        redis = EmbeddedRedis()
        server = start_in_process(load_engine(EngineConfig(args.model, device="cpu")), Directory.connect(redis.url))
        try:
            result = redis_restart_under_load(f"127.0.0.1:{server.port}", redis, workflows, concurrency,
                                              after, args.down, workload=workload)
        finally:
            server.stop()
            redis.stop()
    else:
        from braid.cluster.config import ClusterConfig
        from braid.cluster.local import free_port, start_local_cluster

        config = ClusterConfig(args.model, worker_replicas=2, grpc_port=free_port(), kv_wait_timeout_s=30)
        local = start_local_cluster(config)
        try:
            result = (kill_worker_under_graphs(local.address, workflows, after) if args.graphs else
                      kill_worker_under_load(local.address, workflows, concurrency, after, workload=workload))
        finally:
            local.stop()
    back = "never" if result["recovered_s"] is None else f"{result['recovered_s']:.1f} s later"
    if args.graphs:
        back += ("; a new debate: never" if result["graph_recovered_s"] is None else
                 f"; a new debate: {result['graph_recovered_s']:.1f} s later")
    print(f"{args.fault}: {result['workflows']} {'debates' if args.graphs else 'workflows'} "
          f"({result['in_flight_at_fault']} in flight at the fault, which ended {result['in_flight_outcomes']}), "
          f"outcomes {result['outcomes']} ({result['completed_with_lost_branches']} answered without a lost "
          f"branch; {result['lost_branches']} branches lost), hung {result['hung']}; a new workflow completed: {back}")
    print("PASS" if result["passed"] else "FAIL")
    suffix = "_staircase" if args.staircase else "_graphs" if args.graphs else ""
    name = f"chaos_{args.fault.replace('-', '_')}{suffix}_cpu"
    stem = write_json(args.out, name, {**result, "config": vars(args)}, device="cpu",
                      **fingerprints_at(EngineConfig(args.model)))
    print(f"wrote {stem}.json")
    return 0 if result["passed"] else 1


def _clients_leave_main(args) -> int:
    from braid.cluster.config import ClusterConfig
    from braid.cluster.local import free_port, start_local_cluster
    from braid.engine import EngineConfig
    from braid.methods.calibration import fingerprints_at
    from braid.results import write_json

    local = start_local_cluster(ClusterConfig(args.model, grpc_port=free_port(), kv_transport="grpc",
                                              kv_wait_timeout_s=30))
    try:
        result = clients_leave(local.address, args.workflows or 20, args.grace)
    finally:
        local.stop()
    for way, r in result["ways"].items():
        print(f"{way}: {r['stopped']} of {r['workflows']} stopped on every replica within {args.grace:g} s, "
              f"{r['still_running']} still running, {r['hung']} of them past the wait ({r['left_before_decoding']} "
              f"left before any worker decoded, {r['ended_otherwise']} ended otherwise)")
    print("PASS" if result["passed"] else "FAIL")
    stem = write_json(args.out, "chaos_client_leaves_cpu", {**result, "config": vars(args)}, device="cpu",
                      **fingerprints_at(EngineConfig(args.model)))
    print(f"wrote {stem}.json")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
