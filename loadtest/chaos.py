"""Faults under load: Redis restarted, a Worker or Synthesizer replica killed, replicas replaced, clients gone.

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

`python -m braid.loadtest.chaos kill-synthesizer` starts a local Ray cluster of two colocated Synthesizer
replicas, builds `--sessions` sessions (a prompt and a few greedy replies each, through the agent API) and
records a greedy Decode over each one's last message. Then, under load (session calls on those sessions and
workflows), it SIGKILLs the replica that holds the most sessions (Serve replaces it). It passes when calls were in
flight at the kill, no call hung or failed other than with UNAVAILABLE, a new workflow completes, and afterwards
every session is whole: each of its ids answers GetMessage and the Decode gives the tokens it gave before (the
lost messages encoded again from their lineage). A DATA_LOSS on a message whose record says it cannot be encoded
again (a calibrated answer, a shipped branch) is the promise kept, listed apart; any other failure loses the
session. `rolling-update` does the same with a redeploy under a changed config instead of the kill, which
replaces every replica.

Traffic goes to loopback only. Writes JSON.
"""

import argparse
import asyncio
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from braid.loadtest.run import run_load
from braid.loadtest.workload import Workload
from braid.protos import agent_pb2 as pb
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


# ---- sessions under a lost or replaced Synthesizer replica (kill-synthesizer, rolling-update) ----------------------

SESSION_FAULTS = ("kill-synthesizer", "rolling-update")
FAULTS = {  # (--help lists them)
    "redis-restart": "Redis stopped under load, down --down seconds, started again empty",
    "kill-worker": "one of two Worker replicas killed under load (--staircase, --graphs)",
    "client-leaves": "clients leave mid-stream; every replica idle within --grace seconds",
    "kill-synthesizer": "SIGKILLs the Synthesizer replica holding most --sessions; all answer as before",
    "rolling-update": "as kill-synthesizer, but a redeploy with a changed config replaces the replicas",
}
PROBE = pb.Sampling(max_tokens=6, ignore_eos=True)  # the greedy Decode each session is checked with
RECOMPUTE = {"messages": "ray_braid_recomputed_messages_total", "tokens": "ray_braid_recomputed_tokens_total",
             "seconds": "ray_braid_recompute_seconds_total", "holder_losses": "ray_braid_holder_losses_total"}


@dataclass
class SessionCall:
    """One session call of the load, timed by perf_counter like the workflows' records (so `_hit` and `_outcome`
    take both); `differs`: a Decode that answered other tokens than before the fault."""
    kind: str  # Decode or GetMessage
    session: str
    start: float
    end: float | None = None
    error: str = ""
    differs: bool = False

    @property
    def ok(self) -> bool:
        return not self.error and self.end is not None


def _status(e: grpc.RpcError) -> str:
    return f"{e.code().name}: {e.details()}"


def _decode(stub, session_id: str, parent: str, header: str, metadata, timeout: float = 60.0) -> list:
    """A greedy Decode of PROBE's length over one message of the session; its events."""
    return list(stub.Decode(pb.DecodeRequest(session_id=session_id, calls=[pb.DecodeCallSpec(
        header=header, parents=[parent], sampling=PROBE)]), metadata=metadata, timeout=timeout))


def open_sessions(address: str, count: int, turns: tuple[int, int] = (2, 4),
                  metadata=(("application", "braid"),)) -> list[tuple[str, list[str]]]:
    """`count` sessions through the agent API, each a prompt (Prefill) and `turns` greedy replies (Decode over the
    last message; from the first number to the second, session after session): each session's id and its ids in
    order."""
    out = []
    with grpc.insecure_channel(address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        for s in range(count):
            r = stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text=f"User: session {s}")]),
                             metadata=metadata, timeout=60)
            ids = list(r.message_ids)
            for turn in range(turns[0] + s % (turns[1] - turns[0] + 1)):
                ids.append(_decode(stub, r.session_id, ids[-1], f"A{turn}:", metadata)[-1].message_id)
            out.append((r.session_id, ids))
    return out


def workflow_sessions(address: str, transports: tuple[str, ...], per_transport: int = 2,
                      metadata=(("application", "braid"),)) -> list[tuple[str, list[str]]]:
    """Sessions made by RunWorkflow, `per_transport` over each of `transports` (words of the agent API's enum:
    "grpc", "local", "text"), greedy: each session's id and its ids, the answer first and a branch last (the
    probe's Decode reads the last: a calibrated answer is stored as its adapter's, which no call reads; in text
    mode the answer alone, its branches are not stored)."""
    out = []
    with grpc.insecure_channel(address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        for word in transports:
            for w in range(per_transport):
                done = list(stub.RunWorkflow(pb.WorkflowRequest(
                    task=f"User: add the partial results ({word} {w}).",
                    branch_prompts=["Part 3.", "Part 4 and 5."], synthesis_prompt="Synthesizer:",
                    worker_sampling=PROBE, synthesis_sampling=PROBE,
                    transport=pb.Transport.Value(f"TRANSPORT_{word.upper()}")), metadata=metadata,
                    timeout=120))[-1].done
                out.append((done.session_id, [done.answer_message_id, *done.branch_message_ids]))
    return out


def probe(stub, session_id: str, ids: list[str], metadata) -> dict:
    """Every id of the session through GetMessage, then the greedy Decode over its last message: its tokens (None
    when it failed) and what failed ('STATUS: details', by id; the Decode's under "Decode")."""
    failed = {}
    for mid in ids:
        try:
            stub.GetMessage(pb.GetMessageRequest(session_id=session_id, message_id=mid), metadata=metadata,
                            timeout=60)
        except grpc.RpcError as e:
            failed[mid] = _status(e)
    try:
        tokens = [e.token_id for e in _decode(stub, session_id, ids[-1], "Q:", metadata)]
    except grpc.RpcError as e:
        tokens, failed["Decode"] = None, _status(e)
    return {"tokens": tokens, "failed": failed}


def session_losses(before: dict[str, list[int]], after: dict[str, dict], gaps: dict[tuple[str, str], str]) -> dict:
    """Which sessions a fault lost. `before`: each session's Decode tokens before it; `after`: each one's probe
    afterwards; `gaps`: for a (session, id) that failed with DATA_LOSS, what its directory record says shaped it
    beyond its lineage ("" nothing). A DATA_LOSS where the record names such a gap is the promise kept (it cannot
    be encoded again: a calibrated answer, a shipped branch): listed apart, with why, as is the Decode that then
    fails over it. Any other failure, or a Decode that answers other tokens, loses the session (a bug)."""
    lost, data_loss = {}, []
    for sid, tokens in before.items():
        found = after[sid]
        expected = {mid: f for mid, f in found["failed"].items()
                    if mid != "Decode" and f.startswith("DATA_LOSS") and gaps.get((sid, mid))}
        data_loss += [{"session": sid, "message": mid, "why": gaps[(sid, mid)], "status": f}
                      for mid, f in expected.items()]
        why = [f"{mid}: {f}" for mid, f in found["failed"].items() if mid not in expected
               and not (mid == "Decode" and expected and f.startswith("DATA_LOSS"))]
        if found["tokens"] is not None and found["tokens"] != tokens:
            why.append(f"Decode answered {found['tokens']}, before the fault {tokens}")
        if why:
            lost[sid] = why
    return {"sessions_lost": len(lost), "lost": lost,
            "sessions_data_loss": len({d["session"] for d in data_loss}), "data_loss": data_loss}


def _mixed_load(address: str, sessions: list[tuple[str, list[str]]], before: dict[str, list[int]],
                workload: Workload, concurrency: int, timeout: float, stop: threading.Event, metadata):
    """The load the session faults meet, until `stop`: `workload`'s workflows, `concurrency` at a time (batch after
    batch, so that some are under way whenever the fault comes), and `concurrency` callers going round the sessions
    (each a Decode over a session's last message, checked against `before`, then a GetMessage of it). Returns (a
    thread that ends when all of it has, and {'live': each call's record as it starts})."""
    out: dict = {"live": []}

    def workflows():
        batch, application = 0, dict(metadata)["application"]
        while not stop.is_set():  # (workload.requests(n) are its first n, the same every time)
            batch += 1
            asyncio.run(run_load(address, workload.requests(batch * concurrency)[-concurrency:],
                                 max_concurrency=concurrency, timeout=timeout, application=application,
                                 progress=False, live=out["live"]))

    def caller(first: int):
        with grpc.insecure_channel(address) as channel:
            stub, i = agent_pb2_grpc.AgentServiceStub(channel), first
            while not stop.is_set():
                sid, ids = sessions[i % len(sessions)]
                i += 1
                for kind in ("Decode", "GetMessage"):
                    call = SessionCall(kind, sid, time.perf_counter())
                    out["live"].append(call)
                    try:
                        if kind == "Decode":
                            call.differs = [e.token_id for e in _decode(stub, sid, ids[-1], "Q:", metadata,
                                                                        timeout)] != before[sid]
                        else:
                            stub.GetMessage(pb.GetMessageRequest(session_id=sid, message_id=ids[-1]),
                                            metadata=metadata, timeout=timeout)
                    except grpc.RpcError as e:
                        call.error = _status(e)
                    call.end = time.perf_counter()

    threads = [threading.Thread(target=workflows, daemon=True, name="chaos-load"),
               *(threading.Thread(target=caller, args=(c,), daemon=True, name="chaos-session")
                 for c in range(concurrency))]
    for t in threads:
        t.start()
    everything = threading.Thread(target=lambda: [t.join() for t in threads], daemon=True, name="chaos-load-all")
    everything.start()
    return everything, out


def _replicas(application: str, deployment: str = "Synthesizer") -> list[dict]:
    """The named actors of a deployment's replicas (SERVE_REPLICA::<app>#<deployment>#<replica id>)."""
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{application}#{deployment}#")]


def recompute_counts(metrics_url: str) -> dict[str, float]:
    """The recompute counters (RECOMPUTE) in Ray's Prometheus export, summed over the replicas exported."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    out = dict.fromkeys(RECOMPUTE, 0.0)
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        for key, metric in RECOMPUTE.items():
            if name == metric or name.startswith(metric + "{"):
                out[key] += float(value)
    return out


def _recomputed(metrics_url: str, baseline: dict, at_most: int, within_s: float = 45.0, still_s: float = 12.0) -> dict:
    """The recompute counters' rise since `baseline`, once it has reached `at_most` messages (the replaced replicas'
    messages: a replica that already held a copy of one answers without encoding it again), or has risen and then
    stood still for `still_s` (Ray exports every few seconds), or after `within_s`. A replica that died with counts
    of its own may have left the export."""
    deadline, counts, rise, since = time.monotonic() + within_s, baseline, 0.0, time.monotonic()
    while True:
        try:
            counts = recompute_counts(metrics_url)
        except OSError:
            pass
        now = time.monotonic()
        if counts["messages"] - baseline["messages"] != rise:
            rise, since = counts["messages"] - baseline["messages"], now
        if rise >= at_most or (rise > 0 and now - since >= still_s) or now > deadline:
            return {k: counts[k] - baseline[k] for k in RECOMPUTE}
        time.sleep(2.0)


def _rebuild_timing(calls: list[SessionCall], sessions: set[str], at: float) -> dict:
    """What the recompute cost a caller, from the load's timings: the first session call on a session of the
    replaced replicas that started after the fault and answered (the one likely to have encoded them again), and
    the slowest, each against the mean of the same kind of call before the fault (under the same load)."""
    after = sorted((c for c in calls if c.session in sessions and c.start > at and c.ok), key=lambda c: c.start)

    def row(c):
        same = [b.end - b.start for b in calls if b.ok and b.end <= at and b.kind == c.kind]
        return {"kind": c.kind, "seconds": c.end - c.start, "same_call_before_s": sum(same) / len(same)
                if same else None}

    if not after:
        return {}
    return {"first_call_after": row(after[0]), "slowest_call_after": row(max(after, key=lambda c: c.end - c.start))}


def fault_verdict(result: dict, max_share_encoded: float | None = None) -> list[str]:
    """Why a session fault's run failed (none: it passed): it must have met calls in flight, hung nothing, failed
    calls only with UNAVAILABLE (a lost replica's, to retry), answered every Decode as before, lost no session (a
    DATA_LOSS the record explains is not a loss), served a new workflow afterwards, and (with `max_share_encoded`:
    a drain, whose replicas hand their messages over) encoded again at most that share of the messages the
    replaced replicas held."""
    why = []
    share = result.get("recompute", {}).get("share_of_held")
    if max_share_encoded is not None and share is not None and share > max_share_encoded:
        why.append(f"{share:.0%} of the {result['recompute']['held_messages']} messages the replaced replicas held "
                   f"were encoded again (at most {max_share_encoded:.0%}: they hand them over as they drain)")
    if result["in_flight_at_fault"] < 1:
        why.append("tested nothing: no call was in flight at the fault")
    if result["hung"]:
        why.append(f"{result['hung']} calls hung")
    other = {k: n for k, n in result["calls_failed"].items() if k != "UNAVAILABLE"}
    if other:
        why.append(f"calls failed with {other}")
    if result["decodes_differing"]:
        why.append(f"{result['decodes_differing']} Decodes under load answered other tokens than before")
    if result["sessions_lost"]:
        why.append(f"{result['sessions_lost']} of {result['sessions']} sessions lost: {result['lost']}")
    if result["recovered_s"] is None:
        why.append("no new workflow completed")
    return why


def _sessions_under_fault(address: str, redis_url: str, fault: Callable[[list, dict], tuple[set, float, dict]],
                          sessions: int, concurrency: int, after_s: float, settle_s: float,
                          timeout: float, workload: Workload, metrics_url: str | None,
                          recover_within_s: float, metadata, transports: tuple[str, ...] = (),
                          max_share_encoded: float | None = None) -> dict:
    """`sessions` sessions built and their Decodes recorded, then the load (`_mixed_load`) and, `after_s` into it
    (once a call is under way), `fault(sessions, holders)`: it breaks replicas and returns (the replicas it took
    away, the perf_counter clock of the fault, what to report). The load runs on for `settle_s` after it; then
    every session is probed against before. `during_fault`: how the calls under way at any time between the
    fault's start and its end (a rolling update's span) ended. `transports`: sessions made by workflows over these
    too (workflow_sessions), beside the chat sessions."""
    from braid.runtime.directory import Directory

    directory = Directory.connect(redis_url)
    built = open_sessions(address, sessions, metadata=metadata)
    kinds = {sid: "chat" for sid, _ in built}
    for word in transports:
        made = workflow_sessions(address, (word,), metadata=metadata)
        kinds.update({sid: f"workflow over {word}" for sid, _ in made})
        built += made
    with grpc.insecure_channel(address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        first = {sid: probe(stub, sid, ids, metadata) for sid, ids in built}
    if any(p["failed"] for p in first.values()):
        raise RuntimeError(f"sessions failed before any fault: { {s: p['failed'] for s, p in first.items()} }")
    before = {sid: p["tokens"] for sid, p in first.items()}
    baseline = recompute_counts(metrics_url) if metrics_url else None
    stop = threading.Event()
    thread, out = _mixed_load(address, built, before, workload, concurrency, timeout, stop, metadata)
    _under_way(thread, out, after_s)
    holders = {(sid, mid): directory.lookup(sid, mid).replica for sid, ids in built for mid in ids}
    started = time.monotonic()
    gone, at, info = fault(built, holders)
    done = time.perf_counter()
    back = recovers(address, recover_within_s, metadata)  # (sent after the fault; the load runs on meanwhile)
    recovered = None if back is None else time.monotonic() - started  # (from the fault's start)
    time.sleep(max(0.0, settle_s - (time.monotonic() - started)))
    stop.set()
    thread.join(timeout + 60)
    records = list(out["live"])
    calls = [r for r in records if isinstance(r, SessionCall)]
    with grpc.insecure_channel(address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        after = {sid: probe(stub, sid, ids, metadata) for sid, ids in built}
    gaps = {(sid, mid): _gap(directory, sid, mid) for sid, p in after.items() for mid, f in p["failed"].items()
            if mid != "Decode" and f.startswith("DATA_LOSS")}
    held = {sid for (sid, _), replica in holders.items() if replica in gone}
    held_ids = sum(replica in gone for replica in holders.values())
    recompute = {"held_messages": held_ids, **_rebuild_timing(calls, held, at)}
    if metrics_url:
        recompute.update(source="metrics", **_recomputed(metrics_url, baseline, held_ids))
        recompute["share_of_held"] = recompute["messages"] / held_ids if held_ids else 0.0
    else:
        recompute["source"] = "timings"
    hit = [r for r in records if r.start < at and (r.end is None or r.end > at)]
    met = [r for r in records if r.start < done and (r.end is None or r.end > at)]  # (the update's whole span)
    failed = Counter(_outcome(r) for r in records if not r.ok)
    lost = session_losses(before, after, gaps)
    result = {"sessions": len(built), "messages": len(holders), "sessions_on_replaced": len(held),
              "sessions_by_kind": dict(Counter(kinds.values())),
              "lost_by_kind": dict(Counter(kinds[sid] for sid in lost["lost"])),
              "on_replaced_by_kind": dict(Counter(kinds[sid] for sid in held)),
              "replaced": sorted(gone), **info, "after_s": after_s,
              "calls": dict(Counter(_kind(r) for r in records)), "calls_failed": dict(failed),
              "hung": failed["DEADLINE_EXCEEDED"] + sum(r.end is None for r in records),
              "errors": sorted({r.error for r in records if r.error})[:20], **_hit(records, at),
              "in_flight_by_kind": {kind: dict(Counter(_outcome(r) for r in hit if _kind(r) == kind))
                                    for kind in sorted({_kind(r) for r in hit})},
              "during_fault": dict(Counter(_outcome(r) for r in met)),
              "decodes_differing": sum(c.differs for c in calls if c.ok), **lost,
              # (the holders the directory names now: one encoded again or moved has a new one; one that a live
              # replica held a copy of already is served from that copy, its record left as it was)
              "ids_still_on_replaced": sum(directory.lookup(*key).replica in gone for key in holders),
              "recompute": recompute, "recovered_s": recovered}
    result["why_failed"] = fault_verdict(result, max_share_encoded)
    result["passed"] = not result["why_failed"]
    return result


def _kind(record) -> str:
    """A load record's call: a session call's kind, else RunWorkflow."""
    return getattr(record, "kind", "RunWorkflow")


def _gap(directory, session_id: str, message_id: str) -> str:
    """What the message's directory record says keeps it from being encoded again ("": nothing): what else shaped
    its KV (a calibrated answer), or a parent that is no message of the session (a branch shipped from a worker)."""
    from braid.engine.errors import UnknownMessageError

    lineage = directory.lineage(session_id, message_id)
    if lineage is None or lineage.unrecorded:
        return lineage.unrecorded if lineage else ""
    for parent in lineage.parents:
        try:
            directory.lookup(session_id, parent)
        except UnknownMessageError:
            return f"its parent {parent} is no message of the session (a shipped branch)"
    return ""


def kill_synthesizer_under_load(address: str, redis_url: str, sessions: int = 8, concurrency: int = 4,
                                after_s: float = 3.0, settle_s: float = 8.0,
                                timeout: float = 120.0, workload: Workload = Workload(),
                                metrics_url: str | None = None, recover_within_s: float = 120.0,
                                metadata=(("application", "braid"),), transports: tuple[str, ...] = ()) -> dict:
    """Sessions under load while the Synthesizer replica of the Serve app in this process's Ray that holds the
    last message of the most sessions is SIGKILLed (no restart: Serve replaces it), `after_s` into the load."""
    import ray

    application = dict(metadata)["application"]

    def kill(built, holders):
        replicas = _replicas(application)
        victim = Counter(holders[(sid, ids[-1])] for sid, ids in built).most_common(1)[0][0]
        (actor,) = [a for a in replicas if a["name"].endswith(f"#{victim}")]
        at = time.perf_counter()
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
        return {victim}, at, {"replicas_before": len(replicas), "victim_sessions":
                              sum(holders[(sid, ids[-1])] == victim for sid, ids in built)}

    return _sessions_under_fault(address, redis_url, kill, sessions, concurrency, after_s, settle_s,
                                 timeout, workload, metrics_url, recover_within_s, metadata, transports)


def rolling_update_under_load(address: str, redis_url: str, redeploy: Callable[[], None], sessions: int = 8,
                              concurrency: int = 4, after_s: float = 3.0, settle_s: float = 8.0,
                              timeout: float = 120.0, workload: Workload = Workload(),
                              metrics_url: str | None = None, recover_within_s: float = 120.0,
                              metadata=(("application", "braid"),), transports: tuple[str, ...] = (),
                              max_share_encoded: float = 0.1) -> dict:
    """Sessions under load while `redeploy()` (serve.run with a changed config) replaces every Synthesizer replica
    of the Serve app in this process's Ray, one at a time, `after_s` into the load. The fault is the whole update:
    calls in flight as it starts are the ones it met. Each replica hands its messages over as it drains, so at most
    `max_share_encoded` of those the old replicas held may be encoded again."""
    application = dict(metadata)["application"]

    def update(built, holders):
        replicas = {a["name"].rsplit("#", 1)[1] for a in _replicas(application)}
        at, start = time.perf_counter(), time.monotonic()
        redeploy()
        return replicas, at, {"replicas_before": len(replicas), "update_s": time.monotonic() - start}

    return _sessions_under_fault(address, redis_url, update, sessions, concurrency, after_s, settle_s,
                                 timeout, workload, metrics_url, recover_within_s, metadata, transports,
                                 max_share_encoded)


def main(argv=None) -> int:
    from braid.engine import EngineConfig
    from braid.methods.calibration import fingerprints_at
    from braid.models import REFERENCE_MODEL
    from braid.results import write_json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="faults:\n" + "\n".join(f"  {name:17} {what}" for name, what in FAULTS.items()))
    p.add_argument("fault", choices=tuple(FAULTS), help="what to break (see below)")
    p.add_argument("--model", default=REFERENCE_MODEL, help="checkpoint to serve (default: the reference model)")
    p.add_argument("--workflows", type=int, default=None, help="workflows to send (default: 40 for "
                                                               "redis-restart, 20 for kill-worker, 20 per way "
                                                               "for client-leaves; kill-synthesizer and "
                                                               "rolling-update send them until the run ends)")
    p.add_argument("--concurrency", type=int, default=None, help="workflows in flight (default: 8 for "
                                                                 "redis-restart, all of them for kill-worker; "
                                                                 "kill-synthesizer and rolling-update: 4, and as "
                                                                 "many callers of session calls)")
    p.add_argument("--after", type=float, default=None, help="seconds into the load to break it (default: 2 for "
                                                             "redis-restart, 3 for the others)")
    p.add_argument("--sessions", type=int, default=None,
                   help="kill-synthesizer, rolling-update: sessions built before the load and checked after the "
                        "fault (default: 8)")
    p.add_argument("--split", action="store_true",
                   help="kill-synthesizer, rolling-update: a Worker replica apart from the two Synthesizer replicas, "
                        "its workflows' KV shipped over gRPC (default: colocated, handed over in the store)")
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
    concurrency = args.concurrency or {"redis-restart": 8, **dict.fromkeys(SESSION_FAULTS, 4)}.get(args.fault,
                                                                                                   workflows)
    after = args.after if args.after is not None else (2.0 if args.fault == "redis-restart" else 3.0)
    if workflows < 1 or concurrency < 1 or after < 0 or args.down < 0:
        p.error("--workflows and --concurrency must be >= 1, --after and --down >= 0")
    if args.sessions is not None and (args.fault not in SESSION_FAULTS or args.sessions < 1):
        p.error("--sessions (>= 1) goes with kill-synthesizer and rolling-update")
    if args.split and args.fault not in SESSION_FAULTS:
        p.error("--split goes with kill-synthesizer and rolling-update")
    if args.workflows is not None and args.fault in SESSION_FAULTS:
        p.error(f"{args.fault} sends workflows until the run ends (--concurrency at a time): no --workflows")
    if (args.staircase or args.graphs) and args.fault != "kill-worker":
        p.error("--staircase and --graphs go with kill-worker")
    if args.staircase and args.graphs:
        p.error("--staircase is for workflows; --graphs sends debates")
    if args.grace <= 0:
        p.error(f"--grace must be > 0, got {args.grace}")
    if args.fault == "client-leaves":
        return _clients_leave_main(args)
    if args.fault in SESSION_FAULTS:
        return _sessions_main(args, concurrency, after)
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


def _sessions_main(args, concurrency: int, after: float) -> int:
    """kill-synthesizer and rolling-update on a local Ray: two colocated Synthesizer replicas (one intra-op thread
    each, so that they share two cores), Ray's metrics export on for the recompute counters."""
    import dataclasses

    from ray import serve

    from braid.cluster.app import APP, build_app
    from braid.cluster.config import ClusterConfig
    from braid.cluster.local import free_port, start_local_cluster
    from braid.engine import EngineConfig
    from braid.methods.calibration import fingerprints_at
    from braid.results import write_json

    config = ClusterConfig(args.model, colocate=not args.split, synthesizer_replicas=2, cpu_threads=1,
                           grpc_port=free_port(), kv_wait_timeout_s=30)
    local = start_local_cluster(config, metrics_port=free_port())
    # (sessions made by workflows too: their branches' KV shipped over gRPC from the Worker replica, or handed over
    # in the colocated replica's store; and their text)
    sizes = {"sessions": args.sessions or 8, "concurrency": concurrency, "after_s": after,
             "metrics_url": local.metrics_url, "transports": ("grpc" if args.split else "local", "text")}
    try:
        if args.fault == "kill-synthesizer":
            result = kill_synthesizer_under_load(local.address, local.redis_url, **sizes)
        else:  # (a changed default: every replica's arguments change, so Serve replaces each)
            changed = dataclasses.replace(config, default_max_tokens=config.default_max_tokens + 1)
            result = rolling_update_under_load(
                local.address, local.redis_url,
                lambda: serve.run(build_app(changed, local.redis_url), name=APP, route_prefix=f"/{APP}"), **sizes)
    finally:
        local.stop()
    r, back = result, "never" if result["recovered_s"] is None else f"{result['recovered_s']:.1f} s later"
    print(f"{args.fault}: {r['sessions']} sessions ({r['sessions_on_replaced']} with messages on the replaced "
          f"replicas); {r['in_flight_at_fault']} calls in flight at the fault, which ended {r['in_flight_outcomes']}; "
          f"calls {r['calls']}, failed {r['calls_failed']}; sessions lost {r['sessions_lost']}, DATA_LOSS (as "
          f"their records say) {r['sessions_data_loss']}; recompute {r['recompute']}; a new workflow completed: "
          f"{back}")
    print("PASS" if r["passed"] else "FAIL: " + "; ".join(r["why_failed"]))
    stem = write_json(args.out, f"chaos_{args.fault.replace('-', '_')}{'_split' if args.split else ''}_cpu",
                      {"what": f"{args.fault}: {FAULTS[args.fault]}", **r, "config": vars(args)}, device="cpu",
                      **fingerprints_at(EngineConfig(args.model)))
    print(f"wrote {stem}.json")
    return 0 if r["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
