"""The trace format: recorded (or user-written) workflows, one JSON line each, read back and checked.

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
from collections.abc import Iterator

from braid.models.chat import ROLES

TRACE_VERSION = 1


class TraceError(ValueError):
    """A trace line that cannot be read: names the file, the line and what is wrong."""


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
