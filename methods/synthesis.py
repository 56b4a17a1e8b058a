"""Parallel-Synthesis (Algorithm 1) and its text re-prefill baseline.

Branches are worker output messages: each was decoded after the shared prefix and
its own branch context, so its KV sits at positions n + |c_j| + r. The cache path
attends to copies of those messages re-rotated to a placement, prefills only the
synthesizer prompt, and decodes. The text path re-prefills the branches' tokens
after the shared prefix, reusing the prefix's KV as prefix caching would, so both
run on the same engine with the same tokens.

A boundary refresh (`Refresh`) re-encodes a few tokens at each end of every branch at synthesis time, with
the shared prefix and the earlier branches in view, as KVLink's link tokens and EPIC's recomputed chunk
starts do: a branch encoded alone never saw the others, and its boundary tokens are where the text model
records that it follows them.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Protocol

import torch

from braid.engine.engine import DecodeCall, DecodeStream, Engine, KVTransform, PrefillCall, Sibling, Tokens
from braid.engine.errors import BraidError
from braid.engine.sampling import SamplingParams
from braid.engine.store import Message


class Placement(str, Enum):
    BRANCH_POINT = "branch_point"  # the paper's: every branch starts at the branch point n; prompt after the longest
    SEQUENTIAL = "sequential"  # branches one after another from n; prompt after the last
    NONE = "none"  # no re-encoding: each branch stays where it was decoded; prompt after the furthest end
    # branches encoded apart right after the prefix (each at the branch point: the user's own turns, MultiQA's
    # questions) stay there, as the reference model was fine-tuned to read them (Prompt Choreography); the others
    # (worker replies, encoded after contexts of their own) are laid end to end after the longest of those
    MIXED = "mixed"


def place_branches(branch_point: int, lengths: Sequence[int], placement: Placement,
                   decoded_at: Sequence[int] = ()) -> tuple[list[int], int]:
    """Offsets for each branch and for the synthesizer prompt. `decoded_at`: the branches' own offsets."""
    placement = Placement(placement)
    if placement in (Placement.NONE, Placement.MIXED) and len(decoded_at) != len(lengths):
        raise ValueError(f"placement {placement.value!r} needs every branch's own offset")
    if placement is Placement.NONE:
        return list(decoded_at), max(o + n for o, n in zip(decoded_at, lengths))
    if placement is Placement.BRANCH_POINT:
        return [branch_point] * len(lengths), branch_point + max(lengths)
    apart = kept_apart(branch_point, decoded_at, placement) if decoded_at else [False] * len(lengths)
    at = branch_point + max([n for n, kept in zip(lengths, apart) if kept], default=0)
    offsets = []
    for n, kept in zip(lengths, apart):
        offsets.append(branch_point if kept else at)
        at += 0 if kept else n
    return offsets, at


def kept_apart(branch_point: int, decoded_at: Sequence[int], placement: Placement) -> list[bool]:
    """The branches MIXED keeps where they were encoded (right after the prefix, at the branch point): it reads them
    as encoded, and the refresh leaves them alone. None under any other placement."""
    mixed = Placement(placement) is Placement.MIXED
    return [mixed and at == branch_point for at in decoded_at]


class CacheMapper(Protocol):
    """Calibrates one placed branch's KV copy [L, 2, H, T, D], or a part of it (`length`: the whole branch's
    length, when that differs from T); returns a tensor of the same shape (it may work in place: the copy is
    the engine's own, never stored KV)."""

    def __call__(self, kv: torch.Tensor, *, branch: int, num_branches: int,
                 length: int | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class Refresh:
    """Re-encode the first `head` and last `tail` tokens of every branch after the branch's placement, with the
    shared prefix, every earlier branch and the branch's own earlier tokens in view (parallel prefills, base
    weights, no mapper), and let the synthesizer read those instead of the branch's own KV for them. The rest
    of each branch is read as shipped (through the mapper, when there is one). Why: a branch's ends are where
    shipped KV differs most from text's (they never saw the other branches), and `braid eval` measures what
    re-encoding them gives back."""

    head: int = 1
    tail: int = 1
    # each run reads the runs before it re-encoded, not as shipped: one prefill per run, in order (a study of what
    # the caches lack; a whole-branch sequential refresh is text re-prefill, tested). Parallel runs, the default,
    # are one prefill for all (or the synthesizer's own), and what calibrations train with
    sequential: bool = False
    # branches longer than this many tokens are re-encoded whole: read from their text in the synthesizer's context
    # (the prefix and the earlier branches in view), not from their KV (0: none). The gate's per-branch decision
    # (api.decision): longer than any branch the calibration was verified to read as text does
    whole_over: int = 0

    def __post_init__(self):
        if not all(isinstance(n, int) and n >= 0 for n in (self.head, self.tail, self.whole_over)):
            raise BraidError(f"refresh head, tail and whole_over must be non-negative ints, got {self.head}, "
                             f"{self.tail} and {self.whole_over}")

    def whole(self, length: int) -> bool:
        """Whether a branch of `length` tokens is re-encoded whole (read from its text)."""
        return 0 < self.whole_over < length

    def runs(self, length: int) -> list[tuple[int, int]]:
        """The [start, end) token runs of a branch of `length` tokens that are re-encoded (merged, in order)."""
        if self.whole(length):
            return [(0, length)]
        head, tail = min(self.head, length), max(0, length - self.tail)
        if head >= tail:
            return [(0, length)]
        return [r for r in ((0, head), (tail, length)) if r[0] < r[1]]


def refresh_of(head: int, tail: int = -1) -> Refresh | None:
    """The refresh of `head` tokens at the start and `tail` at the end of every branch (tail -1: as many as head);
    None when that is no token at all."""
    tail = head if tail == -1 else tail
    return Refresh(head, tail) if head or tail else None


@dataclass(frozen=True)
class Runs:
    """Tokens a caller chose to re-encode (refresh_branches' other selection, beside Refresh's two ends), as
    merged [start, end) runs."""

    spans: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, tokens) -> "Runs":
        spans: list[list[int]] = []
        for t in sorted(set(int(t) for t in tokens)):
            if spans and spans[-1][1] == t:
                spans[-1][1] = t + 1
            else:
                spans.append([t, t + 1])
        return cls(tuple((a, b) for a, b in spans))

    def runs(self, length: int) -> list[tuple[int, int]]:
        return [(a, min(b, length)) for a, b in self.spans if a < min(b, length)]


@dataclass
class SynthesisHooks:
    """Where a trained cache mapper and a synthesizer LoRA adapter plug in."""

    mapper: CacheMapper | None = None
    # The synthesizer's adapter (a LoRA), by the id it was added to the engine under (Engine.add_adapter): its
    # rows run on those weights, and the synthesized message is stored as encoded by "<fingerprint>+<id>", so
    # no base-model call takes it as a parent (FAILED_PRECONDITION: re-encode its text).
    adapter: str | None = None


def _check_branches(branches: Sequence[str]) -> None:
    if not branches:
        raise BraidError("synthesis needs at least one branch message id")


def synthesize_stream(engine: Engine, branches: Sequence[str], prompt: Tokens, prefix: Sequence[str] = (),
                      placement: Placement = Placement.BRANCH_POINT, sampling: SamplingParams = SamplingParams(),
                      hooks: SynthesisHooks | None = None, refresh: Refresh | None = None) -> DecodeStream:
    """Cache path: re-encoded branch KV (its boundary tokens refreshed, with `refresh`) + prefilled prompt,
    then decode. The refreshed runs are encoded in the synthesizer's own prefill, as unstored prefill calls of
    its request (base weights, the branches unmapped), so refreshing costs no forward of its own; with more runs
    than one call takes (max_parallel_calls), they are prefilled first instead, a prefill's worth at a time."""
    def decode(lead, parents, offsets, new_offset, transform):
        call = DecodeCall(prompt, parents, offsets, new_offset, sampling, adapter=(hooks or SynthesisHooks()).adapter)
        return engine.decode_stream([*lead, call], transform=transform)

    return _on_placed_branches(engine, branches, prefix, placement, hooks, refresh, decode)


def encode_synthesis_again(engine: Engine, record: "SynthesisRecord", tokens: Sequence[int], message_id: str,
                           hooks: SynthesisHooks | None = None) -> str:
    """A cache-path answer's message (its prompt and answer, `tokens`) encoded again under its own id, as the
    synthesis that made it read the branches: the same placement, refresh and hooks (`hooks`: the calibration the
    record names), its branches and prefix stored here again first. One prefill of all its tokens, through the same
    request as the decode (the refreshed runs first, the mapper on the branches, the adapter on its rows): its KV is
    the decode's within the engine's batched-vs-alone tolerance. Returns its id."""
    def prefill(lead, parents, offsets, new_offset, transform):
        call = PrefillCall(list(tokens), parents, offsets, new_offset, adapter=(hooks or SynthesisHooks()).adapter,
                           id=message_id)
        return engine.prefill([*lead, call], transform=transform)[0]

    return _on_placed_branches(engine, record.branches, record.prefix, record.placement, hooks, record.refresh,
                               prefill)


def _on_placed_branches(engine: Engine, branches: Sequence[str], prefix: Sequence[str], placement: Placement,
                        hooks: SynthesisHooks | None, refresh: Refresh | None, run):
    """The synthesizer's request over the branches placed and refreshed: `run(lead, parents, offsets, new_offset,
    transform)` makes its last call (a decode, or a prefill encoding a decoded answer again) after the `lead`
    prefill calls (the refreshed runs), reading the prefix and the branch pieces, the mapper on the branches."""
    branch_msgs, offsets, prompt_offset, kept = _placed(engine, prefix, branches, placement)
    lead: list[PrefillCall] = []
    if not _from_text(refresh, branch_msgs, kept) and (refresh is None or not (refresh.head or refresh.tail)
                                                           or all(kept)):
        parts = [(m.id, off, j) for j, (m, off) in enumerate(zip(branch_msgs, offsets))]
        temporary: list[str] = []
    else:
        calls, layout, temporary = _refresh_calls(engine, prefix, branch_msgs, offsets, refresh, kept)
        if len(calls) < engine.config.max_parallel_calls:  # (none left: a sequential refresh encoded its runs)
            lead = [replace(c, store=False) for c in calls]
            parts = [(Sibling(p) if isinstance(p, int) else p, off, j) for p, off, j in layout]
        else:
            parts, runs = _prefill_runs(engine, calls, layout, temporary)
            temporary += runs
    try:
        index = {p: j for p, _, j in reversed(parts) if j is not None}
        lengths = {p: branch_msgs[j].num_tokens for p, j in index.items()}
        return run(lead, [*prefix, *(p for p, _, _ in parts)], [None] * len(prefix) + [off for _, off, _ in parts],
                   prompt_offset, hooked(hooks, index, len(branch_msgs), lengths))
    finally:
        for mid in temporary:  # the call pins what it reads: they go when it ends (now, if it failed to start)
            engine.free(mid, when_unpinned=True)


def _placed(engine: Engine, prefix: Sequence[str], branches: Sequence[str], placement: Placement
            ) -> tuple[list[Message], list[int], int, list[bool]]:
    """The branch messages, the offsets they are read at, the prompt's offset, and which are kept apart."""
    _check_branches(branches)
    branch_msgs = [engine.message(m) for m in branches]
    branch_point = sum(engine.message(m).num_tokens for m in prefix)
    decoded_at = [m.offset for m in branch_msgs]
    offsets, prompt_offset = place_branches(branch_point, [m.num_tokens for m in branch_msgs], placement, decoded_at)
    return branch_msgs, offsets, prompt_offset, kept_apart(branch_point, decoded_at, placement)


def read_at(engine: Engine, prefix: Sequence[str], branches: Sequence[str], placement: Placement) -> list[int]:
    """The offsets a cache-path synthesis reads its parents at: the prefix's messages where they are, then the
    branches at their placement (what the answer's record names as its parents' offsets)."""
    return [engine.message(m).offset for m in prefix] + _placed(engine, prefix, branches, placement)[1]


def _from_text(refresh: Refresh | None, branches: Sequence[Message], kept: Sequence[bool]) -> list[int]:
    return [j for j, m in enumerate(branches)
            if refresh is not None and refresh.whole(m.num_tokens) and not (j < len(kept) and kept[j])]


def read_from_text(engine: Engine, branches: Sequence[str], prefix: Sequence[str], mode: "SynthesisMode") -> list[int]:
    """The branches that synthesis in `mode` reads from their text: every one in text mode; on the cache path,
    those re-encoded whole (Refresh.whole_over), not read from their KV (a branch MIXED keeps apart, read as
    encoded at the branch point, never is)."""
    if mode.text:
        return list(range(len(branches)))
    msgs = [engine.message(b) for b in branches]
    branch_point = sum(engine.message(m).num_tokens for m in prefix)
    return _from_text(mode.refresh, msgs, kept_apart(branch_point, [m.offset for m in msgs], mode.placement))


def refresh_branches(engine: Engine, prefix: Sequence[str], branches: Sequence[Message], offsets: Sequence[int],
                     refresh: "Refresh | Runs") -> tuple[list[tuple[str, int, int | None]], list[str]]:
    """Re-encode each branch's runs (its two ends, or the runs given) in parallel prefills of their own (as many
    calls at once as the engine takes; synthesize_stream encodes them in the synthesizer's prefill instead).
    Returns the synthesizer's branch parents in order, as (message id, offset, branch index or None for a
    refreshed run, which the mapper leaves alone), and the temporary messages (views and runs) to free."""
    calls, layout, views = _refresh_calls(engine, prefix, branches, offsets, refresh)
    parts, runs = _prefill_runs(engine, calls, layout, views)
    return parts, views + runs


def _refresh_calls(engine: Engine, prefix: Sequence[str], branches: Sequence[Message], offsets: Sequence[int],
                   refresh: "Refresh | Runs", kept: Sequence[bool] = ()) -> tuple[
                       list[PrefillCall], list[tuple[str | int, int, int | None]], list[str]]:
    """The prefill calls that re-encode each branch's runs, and what the synthesizer reads in their place.

    Each branch is cut at its runs' ends into pieces (views of its shipped KV, no copy). A run starting at token
    a of branch j is encoded at offset_j + a after the prefix, the pieces of branches 0..j-1 and branch j's
    pieces before a, all at their placements: every call reads the same pieces, so one placement of each serves
    them all. A sequential refresh prefills each run here instead, in order, and the runs after it read it in place
    of its piece (no calls are returned). Returns the calls, the synthesizer's branch parents in order as (view id,
    or the index of the call that re-encodes that run; its offset; the branch index, None for a run), and the views
    (and sequential runs) to free. Branches marked in `kept` are read whole as shipped (no runs)."""
    views: list[str] = []
    calls: list[PrefillCall] = []
    layout: list[tuple[str | int, int, int | None]] = []
    before: list[tuple[str, int]] = []  # (view, offset) of every piece of the branches so far
    sequential = isinstance(refresh, Refresh) and refresh.sequential
    try:
        for j, (msg, off) in enumerate(zip(branches, offsets)):
            spans = {} if j < len(kept) and kept[j] else dict(refresh.runs(msg.num_tokens))  # run start -> end
            cuts = sorted({0, msg.num_tokens, *spans, *spans.values()})
            for a, b in zip(cuts, cuts[1:]):
                if a in spans:  # a run, encoded after the pieces before it
                    call = PrefillCall(list(msg.token_ids[a:b]), parents=[*prefix, *(v for v, _ in before)],
                                       offsets=[None] * len(prefix) + [o for _, o in before], new_offset=off + a)
                    if sequential:  # encoded now, and read in place of its piece by every run after it
                        views += engine.prefill([call])
                        layout.append((views[-1], off + a, None))
                        before.append((views[-1], off + a))
                        continue
                    calls.append(call)
                    layout.append((len(calls) - 1, off + a, None))
                views.append(engine.view(msg.id, a, b))
                before.append((views[-1], off + a))
                if a not in spans:
                    layout.append((views[-1], off + a, j))
    except BaseException:
        for mid in views:
            engine.free(mid, when_unpinned=True)
        raise
    return calls, layout, views


def _prefill_runs(engine: Engine, calls: list[PrefillCall], layout, views: list[str]
                  ) -> tuple[list[tuple[str, int, int | None]], list[str]]:
    """Prefill the run calls, a prefill's worth (max_parallel_calls) at a time; the layout with their message ids
    in place of their indices, and those ids. On failure the views and runs made so far are freed."""
    runs: list[str] = []
    try:
        step = engine.config.max_parallel_calls
        for i in range(0, len(calls), step):
            runs += engine.prefill(calls[i:i + step])
    except BaseException:
        for mid in views + runs:
            engine.free(mid, when_unpinned=True)
        raise
    return [(runs[p] if isinstance(p, int) else p, off, j) for p, off, j in layout], runs


def decode_with_hooks(engine: Engine, call: DecodeCall, hooks: SynthesisHooks | None, branch_of: dict[str, int],
                      num_branches: int, lengths: dict[str, int] | None = None,
                      lead: Sequence[PrefillCall] = ()) -> DecodeStream:
    """One synthesizer call through the hooks: the mapper on the branch messages (`branch_of`: id -> branch;
    `lengths`: id -> its whole branch's length, where a message is a part of one), never on the rest (the
    shared prefix, the synthesizer's own context, the `lead` prefill calls of its request); its rows on the
    hooks' adapter (the lead calls run base weights)."""
    return engine.decode_stream([*lead, replace(call, adapter=(hooks or SynthesisHooks()).adapter)],
                                transform=hooked(hooks, branch_of, num_branches, lengths))


def hooked(hooks: SynthesisHooks | None, branch_of: dict[str, int], num_branches: int,
           lengths: dict[str, int] | None = None) -> KVTransform | None:
    """The hooks' mapper as the engine's KV transform over the branch messages (`branch_of`: id -> branch;
    `lengths`: id -> its whole branch's length, where a message is a part of one); None without a mapper."""
    if hooks is None or hooks.mapper is None:
        return None

    def apply(msg: Message, kv: torch.Tensor) -> torch.Tensor:
        return hooks.mapper(kv, branch=branch_of[msg.id], num_branches=num_branches,
                            length=(lengths or {}).get(msg.id))

    return KVTransform(frozenset(branch_of), apply)


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
    refresh: Refresh | None = None  # re-encode each branch's boundary tokens (cache path only)

    @property
    def text(self) -> bool:
        return self.placement is None


TEXT = SynthesisMode()


@dataclass(frozen=True)
class SynthesisRecord:
    """How a cache-path answer read its branches, beyond its own tokens: what `encode_synthesis_again` replays
    (the session's record of the answer carries it, so that the answer can be encoded again where it was lost)."""

    prefix: tuple[str, ...]
    branches: tuple[str, ...]
    placement: Placement
    refresh: Refresh | None = None
    calibration: str = ""  # the digest of the calibration whose mapper and adapter read the branches ("": none)

    def to_json(self) -> list:
        r = self.refresh
        return [list(self.prefix), list(self.branches), Placement(self.placement).value,
                None if r is None else [r.head, r.tail, r.sequential, r.whole_over], self.calibration]

    @classmethod
    def from_json(cls, data: list) -> "SynthesisRecord":
        prefix, branches, placement, refresh, calibration = data
        return cls(tuple(prefix), tuple(branches), Placement(placement),
                   None if refresh is None else Refresh(refresh[0], refresh[1], bool(refresh[2]), refresh[3]),
                   calibration)


def synthesis_stream(engine: Engine, branches: Sequence[str | Sequence[int]], prompt: Tokens,
                     prefix: Sequence[str] = (), mode: SynthesisMode = SynthesisMode(Placement.BRANCH_POINT),
                     sampling: SamplingParams = SamplingParams()) -> DecodeStream:
    """The one synthesis entry point: text re-prefill or the cache path, as `mode` says.
    In text mode a branch may be given as its token ids instead of a stored message."""
    if mode.text:
        return synthesize_text_stream(engine, branches, prompt, prefix, sampling)
    return synthesize_stream(engine, branches, prompt, prefix, mode.placement, sampling, mode.hooks, mode.refresh)


def _run(stream: DecodeStream, on_token) -> str:
    for event in stream:
        if on_token is not None:
            on_token(event)
    return stream.ids[0]


def synthesize(engine: Engine, branches: Sequence[str], prompt: Tokens, prefix: Sequence[str] = (),
               placement: Placement = Placement.BRANCH_POINT, sampling: SamplingParams = SamplingParams(),
               hooks: SynthesisHooks | None = None, on_token=None, refresh: Refresh | None = None) -> str:
    """Returns the id of the synthesized message (prompt + answer)."""
    return _run(synthesize_stream(engine, branches, prompt, prefix, placement, sampling, hooks, refresh), on_token)


def synthesize_text(engine: Engine, branches: Sequence[str], prompt: Tokens, prefix: Sequence[str] = (),
                    sampling: SamplingParams = SamplingParams(), on_token=None) -> str:
    """Returns the id of the synthesized message (branch texts + prompt + answer)."""
    return _run(synthesize_text_stream(engine, branches, prompt, prefix, sampling), on_token)
