"""Recorded workflows: what a cluster served, one JSON line per RunWorkflow request, written off the request path.

A trace line (version 1) holds what a client sent and what the cluster answered, as text:

    {"version": 1, "kind": "workflow", "time": <unix seconds>,
     "task": "<string>" | null,             "task_messages": [{"role", "content"}, ...] | null,
     "branches": [{"prompt": "<string>" | null, "messages": [...] | null, "reply": "<the worker's reply>"}, ...],
     "synthesis": {"prompt": "<string>" | null, "messages": [...] | null},
     "answer": "<the answer>", "reference": "<a reference answer>" | null,
     "model": "<weights' fingerprint>", "calibration": "<its digest>" | "", "transport": "TRANSPORT_..."}

A request sent as strings fills `task` and each `prompt`; one sent as chat messages fills `*messages`. Nothing else
of the request is kept: no session, no API key, no metadata. Traces a user writes themselves need only the
request's parts (`task` or `task_messages`, each branch's `prompt` or `messages`, and the synthesis); `reply`,
`answer`, `model` and `calibration` are then absent, and so not used as training targets. `read_traces` checks each
line and names the file and line of any it refuses.
"""

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator

from braid.models.chat import ROLES
from braid.protos import agent_pb2 as pb

log = logging.getLogger(__name__)
TRACE_VERSION = 1


class TraceError(ValueError):
    """A trace line that cannot be read: names the file, the line and what is wrong."""


# ---- recording ----------------------------------------------------------------------------------------------------
def _messages(messages) -> list[dict] | None:
    return [{"role": m.role, "content": m.content} for m in messages] or None


class WorkflowTrace:
    """One RunWorkflow request's trace, filled from the events its client is sent (WorkflowDriver)."""

    def __init__(self, request: pb.WorkflowRequest, model: str, calibration: str):
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
            "answer": "", "reference": None, "model": model, "calibration": calibration, "transport": ""}
        self.done = False

    def see(self, event: pb.WorkflowEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "branch_token" and event.branch_token.branch < len(self.line["branches"]):
            self.line["branches"][event.branch_token.branch]["reply"] += event.branch_token.text
        elif kind == "decision":
            self.line["transport"] = pb.Transport.Name(event.decision.transport)
        elif kind == "done":
            self.line["answer"], self.done = event.done.answer_text, True


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


# ---- reading --------------------------------------------------------------------------------------------------
def _check_messages(value, where: str) -> None:
    if not isinstance(value, list) or not value:
        raise TraceError(f"{where}: expected a non-empty list of messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise TraceError(f"{where}[{i}]: a message is {{\"role\": one of {', '.join(ROLES)}, \"content\": "
                             f"a string}}; got {m!r}")


def _check(line: dict, where: str) -> dict:
    if not isinstance(line, dict) or line.get("kind", "workflow") != "workflow":
        raise TraceError(f"{where}: a trace line is a JSON object of kind \"workflow\"")
    if line.get("version", TRACE_VERSION) != TRACE_VERSION:
        raise TraceError(f"{where}: trace version {line.get('version')!r}; this Braid reads version {TRACE_VERSION}")
    branches = line.get("branches")
    if not isinstance(branches, list) or not branches:
        raise TraceError(f"{where}: \"branches\" must be a non-empty list")
    chat = line.get("task_messages") is not None or any(b.get("messages") is not None for b in branches
                                                        if isinstance(b, dict))
    if chat:
        if line.get("task_messages") is not None:
            _check_messages(line["task_messages"], f"{where}: task_messages")
        for j, b in enumerate(branches):
            _check_messages(b.get("messages") if isinstance(b, dict) else None, f"{where}: branches[{j}].messages")
        synthesis = (line.get("synthesis") or {}).get("messages")
        if synthesis is not None:
            _check_messages(synthesis, f"{where}: synthesis.messages")
    else:
        for j, b in enumerate(branches):
            if not isinstance(b, dict) or not isinstance(b.get("prompt"), str) or not b["prompt"]:
                raise TraceError(f"{where}: branches[{j}] needs a \"prompt\" (a string) or \"messages\"")
        if not isinstance((line.get("synthesis") or {}).get("prompt"), str):
            raise TraceError(f"{where}: \"synthesis\" needs a \"prompt\" (a string) or \"messages\"")
    return line


def read_traces(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, trace) for each non-empty line of the JSONL file at `path`; a TraceError names the file and
    line of the first it cannot read."""
    with open(path) as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            where = f"{path}, line {number}"
            try:
                line = json.loads(text)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
            yield number, _check(line, where)


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
