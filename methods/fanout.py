"""Workflow building blocks: branches fanned out from a shared task, decoding in parallel.

The worker deployment, the colocated path and the evaluation harness all run their
workers through `fan_out`; synthesis has its one entry point in methods.synthesis
(`synthesis_stream`, text or KV by `SynthesisMode`).
"""

from collections.abc import Callable, Iterator, Sequence

import torch

from braid.engine.engine import DecodeCall, DecodeStream, Engine, PrefillCall, TokenEvent, Tokens
from braid.engine.sampling import SamplingParams


class BranchStream:
    """m branches after one task prefix: prefill the task, prefill each branch's context after it,
    then decode every branch in one parallel batch (one forward per step).

    Iterate for TokenEvents (`event.call` is the branch index); its calls run in the engine's
    scheduler, batched with whatever else is running. `on_start(self)` runs when iteration starts.
    After iteration: `prefix`, `contexts`, `ids` (the branch messages, header + reply) and `offsets`
    (where each branch message begins). A staircase reads the branches as they decode (a BranchFeed source that
    its feed pumps: methods.staircase's ReportedSource).
    """

    def __init__(self, engine: Engine, task: Tokens, contexts: Sequence[Tokens], header: Tokens,
                 sampling: SamplingParams, on_start: Callable[["BranchStream"], None] | None = None,
                 readable: bool = True):
        self.engine, self.task, self.context_texts = engine, task, list(contexts)
        self.header, self.sampling, self.on_start = header, sampling, on_start
        self.readable = readable  # the branches' KV is read while they decode (shipped, or a staircase's)
        self.prefix: list[str] = []
        self.contexts: list[str] = []
        self.offsets: list[int] = []
        self._held: list[str] = []
        self.decode: DecodeStream | None = None

    def __len__(self) -> int:
        return len(self.context_texts)

    def __iter__(self) -> Iterator[TokenEvent]:
        eng = self.engine
        if self.on_start is not None:
            self.on_start(self)
        # what the fan-out stores is held between its calls, so other requests' inserts cannot evict it
        self.prefix = eng.prefill([PrefillCall(self.task)])
        self._held += eng.hold(self.prefix)
        self.contexts = eng.prefill([PrefillCall(c, parents=self.prefix) for c in self.context_texts])
        self._held += eng.hold(self.contexts)
        self.offsets = [eng.message(c).end for c in self.contexts]
        self.decode = eng.decode_stream([DecodeCall(self.header, parents=[*self.prefix, c],
                                                    sampling=self.sampling) for c in self.contexts],
                                        readable=self.readable)
        try:
            yield from self.decode
            self._held += eng.hold(self.decode.ids)
        finally:
            self.decode.close()

    @property
    def ids(self) -> list[str] | None:
        return self.decode.ids if self.decode is not None else None

    def header_length(self, branch: int) -> int:
        """Tokens of the header the branch's message starts with (the same for every branch here)."""
        return len(self.engine.tokenize(self.header) if isinstance(self.header, str) else self.header)

    def encoded(self, branch: int) -> int:
        """Tokens of the branch's message (header + reply so far) that already have KV."""
        return self.decode.encoded(branch) if self.decode is not None else 0

    def partial_kv(self, branch: int, start: int, end: int) -> tuple[list[int], torch.Tensor]:
        """Tokens [start, end) of the branch's message and their KV [L, 2, H, T, D], while it decodes."""
        return self.decode.partial_kv(branch, start, end)

    def free(self, keep_branches: bool = False) -> None:
        """Free what the fan-out stored: the prefix, the contexts and (unless kept) the branch messages."""
        self.engine.release(self._held)
        self._held = []
        keep = set(self.ids or ()) if keep_branches else set()
        self.engine.discard([m for m in [*self.prefix, *self.contexts, *(self.ids or ())] if m not in keep],
                            when_unpinned=False)


def fan_out(engine: Engine, task: Tokens, contexts: Sequence[Tokens], header: Tokens, sampling: SamplingParams,
            on_start: Callable[[BranchStream], None] | None = None, readable: bool = True) -> BranchStream:
    """Branches for `contexts` after `task`, each answering after `header`; iterate the result to run them.
    `readable=False`: nobody reads their KV before they end, so they may take work KV as they decode."""
    return BranchStream(engine, task, contexts, header, sampling, on_start, readable)
