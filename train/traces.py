"""Recorded workflows as calibration data (`braid calibrate --traces`): each trace laid out as the served path lays
it out, its workers' replies reused where these weights wrote them, its target the model's own answer from text.

A trace sent as chat messages is rendered with the model's chat template (ChatRenderer.workflow, as RunWorkflow
renders it); one sent as strings is encoded as given, each worker's reply opening with `worker_header` (the
cluster config's). Recorded replies are training inputs only where the trace's model fingerprint is this
model's: a reply another model wrote is not what these weights decode, so it is generated again.
"""

from dataclasses import dataclass

from braid.models.chat import ChatRenderer, TemplateError
from braid.models.traces import TraceError, read_traces


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
            branches = trace["branches"]
            try:
                if trace.get("task_messages") is not None or any(b.get("messages") is not None for b in branches):
                    renderer = renderer or ChatRenderer(tokenizer, name)
                    task, prompts, synthesis, header = renderer.workflow(
                        trace.get("task_messages") or [], [b["messages"] for b in branches],
                        (trace.get("synthesis") or {}).get("messages") or [])
                else:
                    task, prompts = trace.get("task") or "", [b["prompt"] for b in branches]
                    synthesis, header = trace["synthesis"]["prompt"], worker_header
            except TemplateError as e:
                raise TraceError(f"{where}: {e}") from None
            mine = trace.get("model") == fingerprint and all(b.get("reply") for b in branches)
            out.append(TraceWorkflow(where, task or " ", tuple(prompts), synthesis, header,
                                     tuple(b["reply"] for b in branches) if mine else None, trace.get("reference")))
    return out


def split(workflows: list[TraceWorkflow], every: int) -> tuple[list[TraceWorkflow], list[TraceWorkflow]]:
    """(trained on, held out): every `every`-th trace, from the first, is held out (0: none)."""
    held = [w for i, w in enumerate(workflows) if every and i % every == 0]
    return [w for i, w in enumerate(workflows) if not (every and i % every == 0)], held
