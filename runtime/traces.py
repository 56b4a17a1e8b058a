"""Recorded workflows: what a cluster served, one JSON line per RunWorkflow or RunGraph request (the format:
braid.models.traces), written off the request path; and a trace as the request it records."""

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from braid.models.traces import TRACE_VERSION
from braid.protos import agent_pb2 as pb

log = logging.getLogger(__name__)
# ---- recording ----------------------------------------------------------------------------------------------------
def _messages(messages) -> list[dict] | None:
    return [{"role": m.role, "content": m.content} for m in messages] or None


class WorkflowTrace:
    """One RunWorkflow request's trace, filled from the events its client is sent (WorkflowDriver)."""

    def __init__(self, request: pb.WorkflowRequest, model: str, calibration: str, worker_header: str):
        chat = bool(request.task_messages or request.branch_messages or request.synthesis_messages)
        n = len(request.branch_messages if chat else request.branch_prompts)
        self.line = {
            "version": TRACE_VERSION, "kind": "workflow", "time": time.time(),
            "task": None if chat else request.task, "task_messages": _messages(request.task_messages) if chat else None,
            "branches": [{"prompt": None if chat else request.branch_prompts[j],
                          "messages": _messages(request.branch_messages[j].messages) if chat else None, "reply": ""}
                         for j in range(n)],
            "synthesis": {"prompt": None if chat else request.synthesis_prompt,
                          "messages": _messages(request.synthesis_messages) if chat else None},
            "answer": "", "reference": None, "model": model, "calibration": calibration, "transport": "",
            "worker_header": worker_header}
        self.done = False

    def see(self, event: pb.WorkflowEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "branch_token" and event.branch_token.branch < len(self.line["branches"]):
            self.line["branches"][event.branch_token.branch]["reply"] += event.branch_token.text
        elif kind == "decision":
            self.line["transport"] = pb.Transport.Name(event.decision.transport)
        elif kind == "done":
            self.line["answer"], self.done = event.done.answer_text, True
            self.line["text_branches"] = list(event.done.text_branches)


class GraphTrace:
    """One RunGraph request's trace, filled from the events its client is sent: each node as served (its text, chat
    messages rendered with the model's template, as the graph ran it), its parents and its reply."""

    def __init__(self, graph, model: str, calibration: str):
        """`graph`: the request as runtime.convert.graph validated and rendered it (a methods.dag Graph)."""
        self.line = {
            "version": TRACE_VERSION, "kind": "graph", "time": time.time(),
            "nodes": [{"name": n.name, "text": n.prompt,
                       "parents": [{"node": e.node or None, "message_id": e.message or None, "offset": e.offset}
                                   for e in n.parents],
                       "decode": n.sampling is not None, "output": n.output, "reply": ""} for n in graph.nodes],
            "model": model, "calibration": calibration, "calibrated": graph.calibrated}
        self._nodes = {n["name"]: n for n in self.line["nodes"]}
        self.done = False

    def see(self, event: pb.GraphEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "node_done" and event.node_done.node in self._nodes:
            self._nodes[event.node_done.node]["reply"] = event.node_done.text
        elif kind == "done":
            self.done = True


class TraceRecorder:
    """Appends trace lines to `<directory>/traces-<name>.jsonl` on a thread of its own. `record` never blocks and
    never fails a request: a full queue (more than `max_queued` lines waiting) or a disk that refuses the write
    drops the line, counted in `dropped` (and reported through `on_drop`)."""

    def __init__(self, directory: str, name: str, max_queued: int = 1024,
                 on_drop: Callable[[int], None] | None = None):
        self.path = os.path.join(directory, f"traces-{name}.jsonl")
        self.dropped, self.written = 0, 0
        self._on_drop = on_drop
        self._queue: queue.Queue[dict | None] = queue.Queue(max_queued)
        self._thread = threading.Thread(target=self._write_loop, daemon=True, name="trace-recorder")
        self._thread.start()

    def record(self, line: dict) -> None:
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            self._drop(1, "the queue is full")

    def _drop(self, n: int, why: str) -> None:
        self.dropped += n
        log.warning("%d trace line(s) not recorded to %s: %s", n, self.path, why)
        if self._on_drop is not None:
            self._on_drop(n)

    def _write_loop(self) -> None:
        while (line := self._queue.get()) is not None:
            try:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                with open(self.path, "a") as f:
                    f.write(json.dumps(line, separators=(",", ":")) + "\n")
                self.written += 1
            except OSError as e:
                self._drop(1, f"{type(e).__name__}: {e}")

    def close(self, timeout: float = 10) -> None:
        """Write what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout)


def _chat(messages) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()]


def trace_request(trace: dict) -> pb.WorkflowRequest:
    """The RunWorkflow request a trace records (without its sampling, transport and session: the replayer's)."""
    branches = trace["branches"]
    if trace.get("task_messages") is not None or any(b.get("messages") is not None for b in branches):
        return pb.WorkflowRequest(
            task_messages=_chat(trace.get("task_messages")),
            branch_messages=[pb.Conversation(messages=_chat(b["messages"])) for b in branches],
            synthesis_messages=_chat((trace.get("synthesis") or {}).get("messages")))
    return pb.WorkflowRequest(task=trace.get("task") or "", branch_prompts=[b["prompt"] for b in branches],
                              synthesis_prompt=trace["synthesis"]["prompt"])
