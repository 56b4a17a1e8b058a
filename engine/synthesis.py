"""Parallel-Synthesis (seed 004, Algorithm 1) and its text re-prefill baseline.

Branches are worker output messages: each was decoded after the shared prefix and
its own branch context, so its KV sits at positions n + |c_j| + r. The cache path
attends to copies of those messages re-rotated to a placement, prefills only the
synthesizer prompt, and decodes. The text path re-prefills the branches' tokens
after the shared prefix, reusing the prefix's KV as prefix caching would, so both
run on the same engine with the same tokens.
"""

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch

from braid.engine.engine import DecodeCall, DecodeStream, Engine, Tokens
from braid.engine.errors import BraidError
from braid.engine.sampling import SamplingParams
from braid.engine.store import Message


class Placement(str, Enum):
    BRANCH_POINT = "branch_point"  # the paper's: every branch starts at the branch point n; prompt after the longest
    SEQUENTIAL = "sequential"  # branches one after another from n; prompt after the last
    NONE = "none"  # no re-encoding: each branch stays where it was decoded; prompt after the furthest end


def place_branches(branch_point: int, lengths: Sequence[int], placement: Placement,
                   decoded_at: Sequence[int] = ()) -> tuple[list[int], int]:
    """Offsets for each branch and for the synthesizer prompt. `decoded_at`: the branches' own offsets."""
    placement = Placement(placement)
    if placement is Placement.NONE:
        if len(decoded_at) != len(lengths):
            raise ValueError("placement 'none' needs every branch's own offset")
        return list(decoded_at), max(o + n for o, n in zip(decoded_at, lengths))
    if placement is Placement.BRANCH_POINT:
        return [branch_point] * len(lengths), branch_point + max(lengths)
    offsets, at = [], branch_point
    for n in lengths:
        offsets.append(at)
        at += n
    return offsets, at


class CacheMapper(Protocol):
    """Calibrates one placed branch's KV copy [L, 2, H, T, D]; returns a tensor of the same shape (it may
    work in place: the copy is the engine's own, never stored KV)."""

    def __call__(self, kv: torch.Tensor, *, branch: int, num_branches: int) -> torch.Tensor: ...


@dataclass
class SynthesisHooks:
    """Where a trained cache mapper and a synthesizer LoRA adapter plug in."""

    mapper: CacheMapper | None = None
    adapter: Callable[[], AbstractContextManager] | None = None  # entered around the synthesizer's forwards
    # With an adapter: what the synthesized message is marked as encoded by, since its KV came from adapted
    # weights. The engine stores it under "<model fingerprint>+<tag>", so no base-model call takes it as a
    # parent (FAILED_PRECONDITION: re-encode its text).
    tag: str | None = None


def _check_branches(branches: Sequence[str]) -> None:
    if not branches:
        raise BraidError("synthesis needs at least one branch message id")


def synthesize_stream(engine: Engine, branches: Sequence[str], prompt: Tokens, prefix: Sequence[str] = (),
                      placement: Placement = Placement.BRANCH_POINT, sampling: SamplingParams = SamplingParams(),
                      hooks: SynthesisHooks | None = None) -> DecodeStream:
    """Cache path: re-encoded branch KV + prefilled prompt, then decode."""
    _check_branches(branches)
    prefix_msgs = [engine.message(m) for m in prefix]
    branch_msgs = [engine.message(m) for m in branches]
    branch_point = sum(m.num_tokens for m in prefix_msgs)
    offsets, prompt_offset = place_branches(branch_point, [m.num_tokens for m in branch_msgs], placement,
                                            [m.offset for m in branch_msgs])
    call = DecodeCall(prompt, parents=[*prefix, *branches], offsets=[None] * len(prefix) + offsets,
                      new_offset=prompt_offset, sampling=sampling)
    index = {m.id: j for j, m in reversed(list(enumerate(branch_msgs)))}
    return decode_with_hooks(engine, call, hooks, index, len(branch_msgs))


def decode_with_hooks(engine: Engine, call: DecodeCall, hooks: SynthesisHooks | None, branch_of: dict[str, int],
                      num_branches: int) -> DecodeStream:
    """One synthesizer call through the hooks: the mapper on the branch messages (`branch_of`: id -> branch),
    never on the rest (the shared prefix, the synthesizer's own context); the adapter around its forwards."""
    hooks = hooks or SynthesisHooks()
    transform = None
    if hooks.mapper is not None:
        def transform(msg: Message, kv: torch.Tensor) -> torch.Tensor:
            j = branch_of.get(msg.id)
            return kv if j is None else hooks.mapper(kv, branch=j, num_branches=num_branches)

    return engine.decode_stream([call], transform=transform, adapter=hooks.adapter,
                                tag=hooks.tag if hooks.adapter is not None else None)


def synthesize_text_stream(engine: Engine, branches: Sequence[str | Sequence[int]], prompt: Tokens,
                           prefix: Sequence[str] = (), sampling: SamplingParams = SamplingParams()) -> DecodeStream:
    """Baseline: the branches' tokens (message ids, or token lists) re-prefilled after the cached shared prefix."""
    _check_branches(branches)
    header = [t for b in branches for t in (engine.message(b).token_ids if isinstance(b, str) else b)]
    header += engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    return engine.decode_stream([DecodeCall(header, parents=list(prefix), sampling=sampling)])


@dataclass(frozen=True)
class SynthesisMode:
    """How the synthesizer reads the branches: from their text (placement None), or from their KV
    re-encoded to a placement, optionally through a cache mapper and an adapter."""

    placement: Placement | None = None
    hooks: SynthesisHooks | None = None

    @property
    def text(self) -> bool:
        return self.placement is None


TEXT = SynthesisMode()


def synthesis_stream(engine: Engine, branches: Sequence[str | Sequence[int]], prompt: Tokens,
                     prefix: Sequence[str] = (), mode: SynthesisMode = SynthesisMode(Placement.BRANCH_POINT),
                     sampling: SamplingParams = SamplingParams()) -> DecodeStream:
    """The one synthesis entry point: text re-prefill or the cache path, as `mode` says.
    In text mode a branch may be given as its token ids instead of a stored message."""
    if mode.text:
        return synthesize_text_stream(engine, branches, prompt, prefix, sampling)
    return synthesize_stream(engine, branches, prompt, prefix, mode.placement, sampling, mode.hooks)


def _run(stream: DecodeStream, on_token) -> str:
    for event in stream:
        if on_token is not None:
            on_token(event)
    return stream.ids[0]


def synthesize(engine: Engine, branches: Sequence[str], prompt: Tokens, prefix: Sequence[str] = (),
               placement: Placement = Placement.BRANCH_POINT, sampling: SamplingParams = SamplingParams(),
               hooks: SynthesisHooks | None = None, on_token=None) -> str:
    """Returns the id of the synthesized message (prompt + answer)."""
    return _run(synthesize_stream(engine, branches, prompt, prefix, placement, sampling, hooks), on_token)


def synthesize_text(engine: Engine, branches: Sequence[str], prompt: Tokens, prefix: Sequence[str] = (),
                    sampling: SamplingParams = SamplingParams(), on_token=None) -> str:
    """Returns the id of the synthesized message (branch texts + prompt + answer)."""
    return _run(synthesize_text_stream(engine, branches, prompt, prefix, sampling), on_token)
