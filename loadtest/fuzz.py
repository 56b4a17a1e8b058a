"""Fuzzed agent API requests: every RPC with hostile field values; counts statuses, hangs and crashes.

`python -m braid.loadtest.fuzz --requests 1000` sends well-formed protos whose values are hostile (empty,
huge, negative, NaN, non-ASCII, control characters, ids that do not exist or belong to another session,
offsets past the context, thousands of words) to every RPC of the agent API, a few at a time. Each request
has a deadline; a request still running at its deadline is a hang. Before and after, it runs one fixed
greedy workflow. It passes when no request got UNKNOWN or INTERNAL (an error the server did not mean),
none hung, no request naming another session's message was accepted, the server still answers Health, and
the workflow afterwards gives the same answer as before.

Without --address it serves the reference model in process, on an embedded Redis (loopback only), with two
API keys, and fuzzes that: each request goes with one of the keys, so requests also name the other key's
sessions and messages; with --address it fuzzes a running server (only loopback addresses are accepted).
Writes JSON.
"""

import argparse
import math
import random
import secrets
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from tqdm import tqdm

from braid.api.auth import client_metadata, timeout_metadata
from braid.loadtest.run import check_loopback
from braid.protos import agent_pb2 as pb
from braid.protos import agent_pb2_grpc

UNMEANT = ("UNKNOWN", "INTERNAL")  # statuses no request should get: the server failed in a way it did not mean
WORDS = ("alpha", "x", "é", "日本", "🙂", "\x00", "\n", " ", "Worker:", "<|end|>", "'", "\\u0000")
INTS = (0, 1, -1, 7, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63))
UINTS = (0, 1, 3, 2**16, 2**32 - 1)
FLOATS = (0.0, 0.7, 1.0, -1.0, 2.5, math.nan, math.inf, -math.inf, 1e30)


@dataclass
class Pool:
    """Ids the fuzzer has seen: real sessions and messages, so requests can name them (rightly or not)."""

    sessions: list[str] = field(default_factory=list)
    messages: dict[str, list[str]] = field(default_factory=dict)  # session -> its message ids
    owner: dict[str, str] = field(default_factory=dict)  # message id -> its session
    key: dict[str, int] = field(default_factory=dict)  # session -> the API key (index) that opened it


class Fuzzer:
    def __init__(self, seed: int, pool: Pool):
        self.rng, self.pool = random.Random(seed), pool
        self.hostility = 0.5  # per request: the chance that each value is a hostile one

    def hostile(self) -> bool:
        return self.rng.random() < self.hostility

    # ---- values ----------------------------------------------------------------------------------
    def text(self) -> str:
        if not self.hostile():
            return " ".join(self.rng.choice(("User:", "hello", "add", "the", "parts", "3", "and", "5."))
                            for _ in range(self.rng.randint(1, 8)))
        r = self.rng.random()
        if r < 0.15:
            return ""
        if r < 0.2:
            return "word " * self.rng.choice((2000, 5000))  # past the context
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 12)))

    def session(self) -> str:
        if not self.hostile():
            return self.rng.choice(self.pool.sessions) if self.pool.sessions and self.rng.random() < 0.7 else ""
        r = self.rng.random()
        if r < 0.4 or not self.pool.sessions:
            return ""
        if r < 0.8:
            return self.rng.choice(self.pool.sessions)
        return self.rng.choice(("nope", "x" * 300, "braid:session:*", "../../", "\x00"))

    def message_id(self, session: str) -> str:
        r = self.rng.random()
        own = self.pool.messages.get(session, [])
        if own and (r < 0.5 or not self.hostile()):
            return self.rng.choice(own)
        if r < 0.7 and self.pool.messages:  # another session's
            return self.rng.choice(self.rng.choice(list(self.pool.messages.values())) or ["none"])
        return self.rng.choice(("", "m", "0" * 40, "*", "\x00", "ab" * 200))

    def sampling(self) -> pb.Sampling:
        if not self.hostile():
            return pb.Sampling(max_tokens=self.rng.choice((1, 2, 4, 8)), temperature=self.rng.choice((0.0, 0.7)),
                               top_p=self.rng.choice((0.0, 0.9)), ignore_eos=self.rng.random() < 0.5)
        s = pb.Sampling(max_tokens=self.rng.choice((1, 2, 4, 8, 0, 2**32 - 1, 10**6)),
                        temperature=self.rng.choice(FLOATS), top_p=self.rng.choice(FLOATS),
                        ignore_eos=self.rng.random() < 0.5)
        if self.rng.random() < 0.3:
            s.stop.extend(self.text() for _ in range(self.rng.randint(0, 3)))
        if self.rng.random() < 0.3:
            s.stop_token_ids.extend(self.rng.choice(UINTS) for _ in range(self.rng.randint(0, 3)))
        if self.rng.random() < 0.3:
            s.seed = self.rng.choice((0, 1, 2**64 - 1))
        return s

    def staircase(self) -> pb.StaircaseOptions:
        """Staircase options: sane, or (hostile) zero or huge chunk sizes, too many, any redundancy, any variant."""
        rng, o = self.rng, pb.StaircaseOptions()
        sizes = UINTS if self.hostile() else (2, 8, 128)
        o.proposer_chunks.extend(rng.choice(sizes) for _ in range(rng.choice((0, 1, 2, 9 if self.hostile() else 3))))
        o.aggregator_chunks.extend(rng.choice(sizes) for _ in range(rng.choice((0, 1, 2))))
        if rng.random() < 0.4:
            o.redundancy = rng.choice(UINTS if self.hostile() else (0, 1))
        o.variant = rng.choice(("", "reprefill", "append", "sideways") if self.hostile() else ("", "append"))
        return o

    def placement(self, session: str, spec):
        n = self.rng.randint(0, 3)
        spec.parents.extend(self.message_id(session) for _ in range(n))
        if not self.hostile():
            return spec
        if self.rng.random() < 0.5:
            spec.offsets.extend(self.rng.choice(INTS) for _ in range(self.rng.choice((n, n + 1, max(0, n - 1)))))
        if self.rng.random() < 0.3:
            spec.new_offset = self.rng.choice(INTS)
        return spec

    # ---- requests ----------------------------------------------------------------------------------
    def request(self) -> tuple[str, object]:
        method = self.rng.choice(("RunWorkflow", "Generate", "Prefill", "Prefill", "Decode", "Decode",
                                  "GetMessage", "ListSessions", "CloseSession", "RunAgents", "Health", "RunGraph")
                            + ("Decode",) * 2)
        rng = self.rng
        self.hostility = rng.choice((0.05, 0.3, 0.9))
        sid = self.session()
        if method == "RunWorkflow":
            return method, pb.WorkflowRequest(
                session_id=sid, task=self.text(), branch_prompts=[self.text() for _ in range(rng.choice((0, 1, 2, 3,
                                                                                                         40)))],
                synthesis_prompt=self.text(), worker_sampling=self.sampling(), synthesis_sampling=self.sampling(),
                transport=rng.choice((0, 1, 2, 3, 4, 5, -1, 99)), placement=rng.choice(("", "sequential",
                                                                                       "branch_point", "none",
                                                                                       "diagonal")),
                staircase=self.staircase() if rng.random() < 0.3 else None)
        if method == "Generate":
            return method, pb.GenerateRequest(session_id=sid, prompt=self.text(), sampling=self.sampling())
        if method == "Prefill":
            calls = []
            for _ in range(rng.choice((0, 1, 2, 3, 64))):
                spec = pb.PrefillCallSpec(text=self.text())
                if rng.random() < 0.3:
                    spec.tokens.extend(rng.choice(UINTS) for _ in range(rng.randint(0, 4)))
                calls.append(self.placement(sid, spec))
            return method, pb.PrefillRequest(session_id=sid, calls=calls)
        if method == "Decode":
            calls = []
            for _ in range(rng.choice((0, 1, 2, 3))):
                spec = pb.DecodeCallSpec(header=self.text(), sampling=self.sampling())
                if rng.random() < 0.3:
                    spec.header_tokens.extend(rng.choice(UINTS) for _ in range(rng.randint(0, 4)))
                calls.append(self.placement(sid, spec))
            return method, pb.DecodeRequest(session_id=sid, calls=calls)
        if method == "GetMessage":
            return method, pb.GetMessageRequest(session_id=sid, message_id=self.message_id(sid))
        if method == "CloseSession":
            return method, pb.CloseSessionRequest(session_id=sid if rng.random() < 0.9 else "")  # (now and then)
        if method == "RunAgents":
            agents = [pb.AgentSpec(name=self.text(), prefix=self.text()) for _ in range(rng.choice((0, 1, 2, 3)))]
            return method, pb.AgentsRequest(session_id=sid, agents=agents, user_text=self.text(),
                                            rounds=rng.choice(UINTS[:3]), kvcomm=rng.random() < 0.5,
                                            sampling=self.sampling())
        if method == "RunGraph":
            names = [self.rng.choice(("a", "b", "c", "")) if self.hostile() else f"n{i}"
                     for i in range(rng.choice((0, 1, 2, 3, 5)))]
            nodes = []
            for i, name in enumerate(names):
                parents = []
                for _ in range(rng.randint(0, 3)):
                    if rng.random() < 0.3:
                        parents.append(pb.GraphParent(message_id=self.message_id(sid)))
                    elif names:  # an earlier node, or (hostile) any node: cycles, itself
                        pick = rng.choice(names if self.hostile() else names[:i] or [""])
                        parents.append(pb.GraphParent(node=pick, leak=rng.random() < 0.2))
                    if parents and self.hostile() and rng.random() < 0.3:
                        parents[-1].offset = rng.choice(INTS)
                nodes.append(pb.GraphNode(name=name, prompt=self.text(), role=rng.choice(("", "x", "y")),
                                          parents=parents, decode=rng.random() < 0.6, sampling=self.sampling(),
                                          output=rng.choice(("", "kv", "text", "json") if self.hostile() else
                                                            ("", "kv", "text")),
                                          private=rng.random() < 0.2, staircase=rng.random() < 0.3))
            return method, pb.GraphRequest(session_id=sid, nodes=nodes, calibrated=rng.random() < 0.2,
                                           staircase=self.staircase() if rng.random() < 0.5 else None)
        if method == "ListSessions":
            return method, pb.ListSessionsRequest()
        return method, pb.HealthRequest()


def _learn(pool: Pool, method: str, request, response, key: int = 0) -> None:
    """Remember the ids a successful call returned, for later requests to name; forget a closed session."""
    if method == "CloseSession":
        if request.session_id in pool.sessions:
            pool.sessions.remove(request.session_id)
        return
    sid = getattr(response, "session_id", "") or getattr(request, "session_id", "")
    ids = list(getattr(response, "message_ids", []))
    if method == "Decode":
        ids = [e.message_id for e in response if e.message_id]
        sid = request.session_id
    if method == "RunGraph":
        ids = [e.node_done.message_id for e in response if e.HasField("node_done")]
        sid = next((e.done.session_id for e in response if e.HasField("done")), "")
    if sid and ids:
        if sid not in pool.sessions:
            pool.sessions.append(sid)
        pool.messages.setdefault(sid, []).extend(ids)
        pool.owner.update((m, sid) for m in ids)
        pool.key.setdefault(sid, key)


def named_ids(request) -> list[str]:
    """Every message id a request names."""
    if isinstance(request, (pb.PrefillRequest, pb.DecodeRequest)):
        return [p for c in request.calls for p in c.parents]
    if isinstance(request, pb.GetMessageRequest):
        return [request.message_id]
    if isinstance(request, pb.GraphRequest):
        return [p.message_id for n in request.nodes for p in n.parents if p.message_id]
    return []


def call(stub, method: str, request, deadline_s: float, metadata=()) -> tuple[str, object]:
    """(status name, response: the message, or the list of streamed events)."""
    try:
        fn = getattr(stub, method)
        got = fn(request, timeout=deadline_s, metadata=(*metadata, *timeout_metadata(deadline_s)))
        if not hasattr(got, "ListFields"):  # a stream
            got = list(got)
        return "OK", got
    except grpc.RpcError as e:
        return e.code().name, e.details()


REFERENCE = pb.WorkflowRequest(task="User: add the partial results.", branch_prompts=["Part 3.", "Part 4 and 5."],
                               synthesis_prompt="Synthesizer:", worker_sampling=pb.Sampling(max_tokens=6,
                                                                                            ignore_eos=True),
                               synthesis_sampling=pb.Sampling(max_tokens=6, ignore_eos=True),
                               transport=pb.TRANSPORT_TEXT)


def reference_answer(stub, metadata=()) -> list[int]:
    events = list(stub.RunWorkflow(REFERENCE, timeout=120, metadata=metadata))
    return [e.synthesis_token.token_id for e in events if e.HasField("synthesis_token")]


def fuzz(address: str, requests: int, seed: int = 0, concurrency: int = 4, deadline_s: float = 60.0,
         metadata=(), progress: bool = True, keys: Sequence[str] = ()) -> dict:
    """Send `requests` fuzzed requests to the agent API at `address`; returns the report (see `passed`). With
    `keys` (API keys the server accepts), each request goes with one of them, drawn at random, so requests also
    name sessions and messages of another key's."""
    check_loopback(address)
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
    stub = agent_pb2_grpc.AgentServiceStub(channel)
    as_key = [(*metadata, *client_metadata(k)) for k in keys] or [tuple(metadata)]
    before = reference_answer(stub, as_key[0])
    pool, statuses, by_method, unmeant = Pool(), Counter(), {}, []
    foreign = Counter()  # requests naming another session's (or key's) session or message: sent, accepted
    fuzzer, draw = Fuzzer(seed, pool), random.Random(seed + 1)
    start = time.perf_counter()

    def one(item):
        method, request, key = item
        sid = getattr(request, "session_id", "")
        other_session = any(pool.owner.get(m, sid) != sid for m in named_ids(request))
        other_key = bool(sid) and pool.key.get(sid, key) != key
        status, got = call(stub, method, request, deadline_s, as_key[key])
        if status == "OK":
            _learn(pool, method, request, got, key)
        if other_session or other_key:
            foreign["sent"] += 1
            foreign["accepted"] += status == "OK"
            foreign["other_key"] += other_key
        return method, request, status, got

    with ThreadPoolExecutor(concurrency) as ex, tqdm(total=requests, desc="fuzzing", unit="req",
                                                     disable=not progress) as bar:
        sent = 0
        while sent < requests:  # in waves, so later requests can name ids earlier ones made
            wave = [(*fuzzer.request(), draw.randrange(len(as_key)))
                    for _ in range(min(4 * concurrency, requests - sent))]
            for method, request, status, got in ex.map(one, wave):
                statuses[status] += 1
                by_method.setdefault(method, Counter())[status] += 1
                if status in UNMEANT or status == "DEADLINE_EXCEEDED":
                    unmeant.append({"method": method, "status": status, "details": str(got)[:500],
                                    "request": str(request)[:500]})
                bar.update()
            sent += len(wave)
    seconds = time.perf_counter() - start
    try:
        healthy = stub.Health(pb.HealthRequest(), timeout=30, metadata=as_key[0]).status == "SERVING"
        after = reference_answer(stub, as_key[0])
    except grpc.RpcError as e:
        healthy, after = False, [f"{e.code().name}: {e.details()}"]
    channel.close()
    hangs = statuses["DEADLINE_EXCEEDED"]
    bad = sum(statuses[s] for s in UNMEANT)
    return {"requests": requests, "seconds": seconds, "statuses": dict(statuses),
            "by_method": {m: dict(c) for m, c in by_method.items()}, "unknown_or_internal": bad, "hangs": hangs,
            "healthy_after": healthy, "answer_before": before, "answer_after": after,
            "cross_session_references": foreign["sent"], "cross_session_accepted": foreign["accepted"],
            "cross_key_references": foreign["other_key"], "keys": len(keys),
            "same_answer": before == after,
            "passed": bad == 0 and hangs == 0 and healthy and before == after and not foreign["accepted"],
            "failures": unmeant[:50]}


def format_report(r: dict) -> str:
    lines = [f"{r['requests']} fuzzed requests in {r['seconds']:.1f} s"]
    lines += [f"  {status:<20} {n}" for status, n in sorted(r["statuses"].items(), key=lambda x: -x[1])]
    lines.append(f"UNKNOWN/INTERNAL: {r['unknown_or_internal']}, hangs: {r['hangs']}, serving afterwards: "
                 f"{r['healthy_after']}, same workflow answer as before: {r['same_answer']}, requests naming another "
                 f"session's message or another key's session: {r['cross_session_references']} "
                 f"({r['cross_key_references']} across keys; {r['cross_session_accepted']} accepted)")
    lines += [f"  {f['method']} -> {f['status']}: {f['details']}" for f in r["failures"][:10]]
    return "\n".join(lines)


def main(argv=None) -> int:
    from braid.models import REFERENCE_MODEL
    from braid.results import write_json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", help="a running agent API, host:port on loopback (default: serve --model in "
                                     "process)")
    p.add_argument("--model", default=REFERENCE_MODEL, help="checkpoint to serve in process (default: the "
                                                            "reference model)")
    p.add_argument("--requests", type=int, default=1000, help="how many requests (default: 1000)")
    p.add_argument("--seed", type=int, default=0, help="fuzzer seed (default: 0)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default: 4)")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds before a request counts as hung "
                                                                "(default: 60)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.deadline <= 0:
        p.error("--requests and --concurrency must be >= 1 and --deadline positive")
    server = redis = None
    address = args.address
    measured = {"model": "unknown", "calibration": "unknown"}  # (a server elsewhere: what it runs is not known here)
    if address is None:
        from braid.api.auth import ApiKeys
        from braid.cluster.inprocess import start_in_process
        from braid.engine import EngineConfig
        from braid.methods.calibration import fingerprints, load_engine
        from braid.runtime.directory import Directory, EmbeddedRedis

        redis = EmbeddedRedis()
        keys = [secrets.token_urlsafe(24) for _ in range(2)]  # two tenants: requests also cross between them
        engine = load_engine(EngineConfig(args.model, device="cpu"))
        measured = fingerprints(engine)
        server = start_in_process(engine, Directory.connect(redis.url),
                                  keys=ApiKeys.parse([f"tenant{i}:{k}" for i, k in enumerate(keys)], "fuzz"))
        address = f"127.0.0.1:{server.port}"
    try:
        report = fuzz(address, args.requests, args.seed, args.concurrency, args.deadline,
                      keys=keys if server is not None else ())
    finally:
        if server is not None:
            server.stop()
            redis.stop()
    print(format_report(report))
    print("PASS" if report["passed"] else "FAIL")
    stem = write_json(args.out, "fuzz_cpu", {**report, "config": vars(args)}, device="cpu", **measured)
    print(f"wrote {stem}.json")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
