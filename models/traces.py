"""The trace format: recorded (or user-written) workflows, one JSON line each, read back and checked.

A trace line (version 1) holds what a client sent and what the cluster answered, as text:

    {"version": 1, "kind": "workflow", "time": <unix seconds>,
     "task": "<string>" | null,             "task_messages": [{"role", "content"}, ...] | null,
     "branches": [{"prompt": "<string>" | null, "messages": [...] | null, "reply": "<the worker's reply>"}, ...],
     "synthesis": {"prompt": "<string>" | null, "messages": [...] | null},
     "answer": "<the answer>", "reference": "<a reference answer>" | null,
     "model": "<weights' fingerprint>", "calibration": "<its digest>" | "", "transport": "TRANSPORT_...",
     "text_branches": [<the branches the answer read from their text>, ...],
     "worker_header": "<what opened each worker's reply>"}

A RunGraph request is a line of kind "graph", each node as it was served:

    {"version": 1, "kind": "graph", "time": <unix seconds>,
     "nodes": [{"name": "<name>", "text": "<its text as encoded: chat messages rendered>",
                "parents": [{"node": "<name>" | null, "message_id": "<a session message>" | null,
                             "offset": <int> | null}, ...],
                "decode": true | false, "output": "kv" | "text", "reply": "<its reply>"}, ...],
     "model": "<weights' fingerprint>", "calibration": "<its digest>" | "", "calibrated": true | false}

Calibration and verification read the syntheses a graph holds (`graph_workflows`); load tests replay workflows only.

A request sent as strings fills `task` and each `prompt` (and `worker_header` says how the workers' replies were
opened, which a trace read back lays them out with); one sent as chat messages fills `*messages`. Nothing else
of the request is kept: no session, no API key, no metadata. Traces a user writes themselves need only the
request's parts (`task` or `task_messages`, each branch's `prompt` or `messages`, and the synthesis); `reply`,
`answer`, `model` and `calibration` are then absent, and so not used as training targets. `read_traces` checks each
line and names the file and line of any it refuses.
"""

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass

from braid.models.chat import ROLES, ChatRenderer, TemplateError

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


def _check_graph(line: dict, where: str) -> dict:
    nodes = line.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise TraceError(f"{where}: \"nodes\" must be a non-empty list")
    for i, n in enumerate(nodes):
        parents = n.get("parents", []) if isinstance(n, dict) else None
        if not (isinstance(n, dict) and isinstance(n.get("name"), str) and isinstance(n.get("text"), str)
                and isinstance(n.get("reply", ""), str) and isinstance(n.get("decode", False), bool)
                and isinstance(parents, list) and all(
                    isinstance(p, dict) and isinstance(p.get("node") or "", str)
                    and isinstance(p.get("message_id") or "", str) and isinstance(p.get("offset") or 0, int)
                    for p in parents)):
            raise TraceError(f"{where}: nodes[{i}] is {{\"name\": a string, \"text\": a string, \"parents\": "
                             f"[{{\"node\" or \"message_id\", \"offset\"}}, ...], \"decode\", \"reply\"}}; got {n!r}")
    return line


def _check(line: dict, where: str) -> dict:
    if not isinstance(line, dict) or line.get("kind", "workflow") not in ("workflow", "graph"):
        raise TraceError(f"{where}: a trace line is a JSON object of kind \"workflow\" or \"graph\"")
    if line.get("version", TRACE_VERSION) != TRACE_VERSION:
        raise TraceError(f"{where}: trace version {line.get('version')!r}; this Braid reads version {TRACE_VERSION}")
    if line.get("kind") == "graph":
        return _check_graph(line, where)
    branches = line.get("branches")
    if not isinstance(branches, list) or not branches:
        raise TraceError(f"{where}: \"branches\" must be a non-empty list")
    chat = line.get("task_messages") is not None or any(b.get("messages") is not None for b in branches
                                                        if isinstance(b, dict))
    if chat:
        _check_messages(line.get("task_messages"), f"{where}: task_messages")
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


# ---- traces as workflows for a model: what calibration (braid calibrate --traces) and verification read -----------
@dataclass(frozen=True)
class TraceWorkflow:
    """One trace, as strings the encoder tokenizes (each message on its own, as the engine encodes it)."""

    where: str  # "<file>, line <n>"
    task: str
    prompts: tuple[str, ...]  # each worker's prompt, after the task
    synthesis: str  # the synthesis prompt, its header opening the answer
    header: str  # opens each worker's reply
    replies: tuple[str, ...] | None  # the recorded replies, where these weights wrote them (None: decode again)
    reference: str | None = None  # a reference answer, where the trace carries one

    @property
    def branches(self) -> int:
        return len(self.prompts)


def load_trace_workflows(paths: list[str], tokenizer, fingerprint: str, worker_header: str, name: str = ""
                         ) -> list[TraceWorkflow]:
    """Every trace in `paths`, rendered for this model. A line that cannot be read, or that this model's chat
    template cannot render, is refused with a TraceError naming its file, line and reason."""
    renderer: ChatRenderer | None = None
    out = []
    for path in paths:
        for number, trace in read_traces(path):
            where = f"{path}, line {number}"
            if trace.get("kind") == "graph":
                out += graph_workflows(trace, where, fingerprint)
                continue
            branches = trace["branches"]
            try:
                if trace.get("task_messages") is not None or any(b.get("messages") is not None for b in branches):
                    renderer = renderer or ChatRenderer(tokenizer, name)
                    task, prompts, synthesis, header = renderer.workflow(
                        trace.get("task_messages") or [], [b["messages"] for b in branches],
                        (trace.get("synthesis") or {}).get("messages") or [])
                else:
                    task, prompts = trace.get("task") or "", [b["prompt"] for b in branches]
                    synthesis, header = trace["synthesis"]["prompt"], trace.get("worker_header") or worker_header
            except TemplateError as e:
                raise TraceError(f"{where}: {e}") from None
            mine = trace.get("model") == fingerprint and all(b.get("reply") for b in branches)
            out.append(TraceWorkflow(where, task or " ", tuple(prompts), synthesis, header,
                                     tuple(b["reply"] for b in branches) if mine else None, trace.get("reference")))
    return out


def graph_workflows(trace: dict, where: str, fingerprint: str) -> list[TraceWorkflow]:
    """The syntheses a recorded graph holds, as workflows. A synthesis is a decoding node whose parents are a shared
    prefix (nodes each reading the ones before it) and then two or more decoding nodes with one text (the header
    their replies follow), each reading the prefix and then a context of its own (a node reading the prefix), every
    edge a node of the graph at its default offset: the prefix is the task, the contexts the workers' prompts, the
    decoding parents' replies theirs, and the node's text the synthesis prompt. Its nodes' texts are as they were
    served (rendered with the recording model's template). Other nodes are not calibrated from."""
    nodes = {n["name"]: n for n in trace["nodes"]}

    def refs(node: dict) -> list[str] | None:  # (its parents' names; None where one is no plain node edge)
        out = []
        for p in node.get("parents") or []:
            if not p.get("node") or p.get("message_id") or p.get("offset") is not None or p["node"] not in nodes:
                return None
            out.append(p["node"])
        return out

    def synthesis(final: dict) -> TraceWorkflow | None:
        parents = refs(final)
        if not final.get("decode") or not parents:
            return None
        k = next((i for i, name in enumerate(reversed(parents)) if not nodes[name].get("decode")), len(parents))
        prefix, branches = parents[:len(parents) - k], [nodes[name] for name in parents[len(parents) - k:]]
        if k < 2 or not prefix or any(refs(nodes[name]) != prefix[:i] for i, name in enumerate(prefix)) \
                or len({b["text"] for b in branches}) != 1:
            return None
        contexts = []
        for b in branches:
            read = refs(b)
            if read is None or read[:-1] != prefix or len(read) != len(prefix) + 1:
                return None
            context = nodes[read[-1]]
            if context.get("decode") or refs(context) != prefix:
                return None
            contexts.append(context["text"])
        task = "".join(nodes[name]["text"] + (nodes[name].get("reply") or "" if nodes[name].get("decode") else "")
                       for name in prefix)
        replies = tuple(b.get("reply") or "" for b in branches)
        mine = trace.get("model") == fingerprint and all(replies)
        return TraceWorkflow(f"{where}, node {final['name']}", task, tuple(contexts), final["text"],
                             branches[0]["text"], replies if mine else None)

    return [w for w in map(synthesis, trace["nodes"]) if w is not None]


SPLIT_RULE = ("stratified by kind (a workflow's branch count and task text): the distinct workflows (sha256 of task, "
              "workers' prompts, reply header and synthesis prompt) ordered by kind digest and, within a kind, by "
              "their own digest, and every N-th of that order held out from the first, so each kind holds out "
              "within one of its 1/N share; copies of one workflow fall on one side")


def workflow_digest(workflow: TraceWorkflow) -> str:
    """sha256 of what a workflow asks: its task, workers' prompts, reply header and synthesis prompt. Not where it
    was read from, its recorded replies or its reference answer: adding references to held-out lines, or reading
    the file in another order, leaves it as it is."""
    text = json.dumps([workflow.task, list(workflow.prompts), workflow.header, workflow.synthesis])
    return hashlib.sha256(text.encode()).hexdigest()


def workflow_kind(workflow: TraceWorkflow) -> str:
    """The stratum a workflow is held out in: its branch count and its task (the shared system text every worker
    reads, which a served application's workflows of one kind share)."""
    return json.dumps([workflow.branches, workflow.task])


def split(workflows: list[TraceWorkflow], every: int) -> tuple[list[TraceWorkflow], list[TraceWorkflow]]:
    """(trained on, held out), each in the order given: one in `every` held out (0: none), stratified by kind
    (SPLIT_RULE). The distinct workflows are put in order by their kind's digest and, within a kind, by their own
    (workflow_digest), and every `every`-th of that order is held out from the first: systematic sampling over the
    strata, so that each kind holds out the floor or the ceiling of its share and all kinds together ceil(n /
    every), kinds of one workflow each included. It depends on the workflows' contents only: the same in every
    process and for any line order, so `braid calibrate --traces` and `braid eval --traces --held-out-traces`
    given the same files and N agree. A workflow recorded twice is held out or trained on whole, never both."""
    if every < 0:
        raise ValueError(f"held-out traces: every must be >= 0 (0: none held out), got {every}")
    if not every:
        return list(workflows), []
    kinds: dict[str, set[str]] = {}
    for w in workflows:
        kinds.setdefault(hashlib.sha256(workflow_kind(w).encode()).hexdigest(), set()).add(workflow_digest(w))
    order = [d for kind in sorted(kinds) for d in sorted(kinds[kind])]
    held = set(order[::every])
    out: tuple[list[TraceWorkflow], list[TraceWorkflow]] = ([], [])
    for w in workflows:
        out[workflow_digest(w) in held].append(w)
    return out
