"""The workflow mix a load test sends: synthetic tasks as agent-API requests, seeded."""

import random
from dataclasses import dataclass

from braid.models.chat import turn
from braid.models.tasks import TASKS, Task, generate
from braid.models.traces import read_traces
from braid.protos import agent_pb2 as pb
from braid.runtime.traces import trace_request

# a request's transport by its word: auto (the cluster decides), or one of the API's Transport values
TRANSPORT_CHOICES = {"auto": pb.TRANSPORT_UNSPECIFIED, **{name.removeprefix("TRANSPORT_").lower(): number
                                                        for name, number in pb.Transport.items() if number}}


@dataclass(frozen=True)
class Workload:
    tasks: tuple[str, ...] = ("chain", "vote", "trail")  # drawn uniformly per request
    branches: tuple[int, ...] = (2, 4)  # branch counts, drawn uniformly
    length: tuple[int, int] = (2, 6)  # each branch's work (models.tasks)
    transports: tuple[str, ...] = ("auto",)  # drawn uniformly: auto, text, grpc, local
    worker_max_tokens: int = 32
    answer_max_tokens: int = 48
    seed: int = 0
    staircase: str = ""  # a staircase variant (reprefill, append) for every request; "" none

    def __post_init__(self):
        bad = [t for t in self.tasks if t not in TASKS]
        if not self.tasks or bad:
            raise ValueError(f"tasks must be some of {', '.join(TASKS)}; got {', '.join(self.tasks) or 'none'}")
        if not self.branches or any(not 1 <= m <= 12 for m in self.branches):
            raise ValueError(f"branch counts must be in 1..12, got {self.branches}")
        bad = [t for t in self.transports if t not in TRANSPORT_CHOICES]
        if not self.transports or bad:
            raise ValueError(f"transports must be some of {', '.join(TRANSPORT_CHOICES)}; got {self.transports}")
        if self.worker_max_tokens < 1 or self.answer_max_tokens < 1:
            raise ValueError("worker_max_tokens and answer_max_tokens must be >= 1")
        if self.staircase not in ("", "reprefill", "append"):
            raise ValueError(f"staircase must be reprefill, append or empty, got {self.staircase!r}")
        if self.staircase and set(self.transports) - {"grpc"}:
            raise ValueError(f"a staircase reads KV as it arrives: its transport must be grpc, got {self.transports}")

    def requests(self, n: int) -> list[pb.WorkflowRequest]:
        """n requests; the same seed gives the same requests."""
        rng = random.Random(self.seed)
        out = []
        for i in range(n):
            task = generate(rng.choice(self.tasks), self.seed * 100_003 + i, rng.choice(self.branches), self.length)
            request = task_request(task, pb.Sampling(max_tokens=self.worker_max_tokens),
                                   pb.Sampling(max_tokens=self.answer_max_tokens),
                                   TRANSPORT_CHOICES[rng.choice(self.transports)])
            if self.staircase:
                request.staircase.CopyFrom(pb.StaircaseOptions(variant=self.staircase))
            out.append(request)
        return out


def trace_requests(paths: list[str], n: int, worker_max_tokens: int, answer_max_tokens: int,
                   transports: tuple[str, ...] = ("auto",), seed: int = 0
                   ) -> tuple[list[pb.WorkflowRequest], list[float]]:
    """n requests replaying the workflows recorded in the trace files at `paths` (runtime.traces; graphs are left
    out), in the order of
    their recorded times and again from the first when there are fewer; and the gaps (seconds) between their
    recorded arrivals, for a replay at the recorded rate. Sampling and transport are the load test's, as for
    generated workloads."""
    traces = [t for path in paths for _, t in read_traces(path) if t.get("kind", "workflow") == "workflow"]
    traces = sorted(traces, key=lambda t: float(t.get("time") or 0)) if all(t.get("time") for t in traces) else traces
    if not traces:
        raise ValueError(f"{', '.join(paths)} hold no workflow traces (graph traces are not replayed)")
    rng = random.Random(seed)
    requests, times = [], []
    for i in range(n):
        trace = traces[i % len(traces)]
        request = trace_request(trace)
        request.worker_sampling.CopyFrom(pb.Sampling(max_tokens=worker_max_tokens))
        request.synthesis_sampling.CopyFrom(pb.Sampling(max_tokens=answer_max_tokens))
        request.transport = TRANSPORT_CHOICES[rng.choice(transports)]
        requests.append(request)
        times.append(trace.get("time"))
    # (a trace written by hand may have no time: no wait before or after it)
    gaps = [max(0.0, float(b) - float(a)) if i % len(traces) and a is not None and b is not None else 0.0
            for i, (a, b) in enumerate(zip(times, times[1:]), 1)]
    return requests, gaps


def task_request(task: Task, worker: pb.Sampling, answer: pb.Sampling,
                 transport: int = pb.TRANSPORT_UNSPECIFIED) -> pb.WorkflowRequest:
    """A reference task as a workflow request, in the reference model's chat turns."""
    return pb.WorkflowRequest(task=turn("system", task.system),
                              branch_prompts=[turn("user", b.context) for b in task.branches],
                              synthesis_prompt=task.prompt(), transport=transport, worker_sampling=worker,
                              synthesis_sampling=answer)
