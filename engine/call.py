"""One call from admission to completion: its tokens, where they sit, their KV slots, what it sampled, its status.

A request (engine.scheduler.Request) is one or more calls run together: a prefill request's calls each
encode a message; a decode request's calls each sample a message after their header, and may be preceded by
prefill calls of the same request that they read (their tokens are encoded first, in the same forwards). Each
call carries its own options: the adapter its forwards run on (an id the engine knows) and whether its message
is stored when the request ends.
"""

import enum
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from braid.engine.detokenize import Detokenizer
from braid.engine.sampling import SamplingParams, make_generator
from braid.engine.store import Message

Tokens = str | Sequence[int]


class CallStatus(enum.Enum):
    ENCODING = "encoding"  # rows of its own tokens (message or header) still to encode
    DECODING = "decoding"  # sampling a token a step
    STOPPED = "stopped"  # a decode call that sampled a stop token or string
    LENGTH = "length"  # a decode call that sampled max_tokens
    ENCODED = "encoded"  # a prefill call whose tokens all have KV


class Adapter(Protocol):
    """Weights other than the base ones, for the calls that name it by the id it was added under
    (Engine.add_adapter; a merged LoRA: methods.calibration.MergedLora). The scheduler enters `adapter()` around a
    forward to put its weights in place over every row, or `adapter(rows=bool [rows])` over those rows only, the
    others running the base weights. Decode forwards may be replayed from CUDA graphs captured under it
    (engine.cuda_graphs), keyed by it: it must be one stable object, and entered without rows it must put the
    same persistent tensors in place each time, with no other effect on the forward."""

    mixes_rows: bool  # `adapter(rows=...)` reads its weights on those rows only: other requests' rows may join

    def __call__(self, rows: torch.Tensor | None = None) -> AbstractContextManager: ...


@dataclass
class TokenEvent:
    call: int  # index of the call among its request's decode calls
    token_id: int
    text: str  # text newly decodable with this token
    finish_reason: str | None = None  # "stop" or "length" on a call's last token
    message_id: str | None = None  # on a call's last token; stored once the whole stream has ended


@dataclass(eq=False)
class Call:
    """One call of a request, from planning to its stored message. `tokens` is its message (prefill) or header
    (decode), from position `offset`; `prefix`, a cached start of its message reused from the prefix cache, comes
    before them (its KV is a lent parent, not encoded again). `parents` and `parent_offsets` are what its message
    records it read (no siblings, no lent start); `content_seed`, what its KV is a function of before its own tokens
    (engine.prefix_cache), when it is cacheable. `slots[i]`: the work-cache slot of its i-th encoded token
    (generated ones too)."""

    tokens: list[int]
    offset: int
    message_id: str
    sampling: SamplingParams | None = None  # None: a prefill call, which samples nothing
    store: bool = True  # its message is stored when the request ends (False: read by its request's calls only)
    adapter: str | None = None  # the adapter its rows run on (Engine.add_adapter); None: the base weights
    parents: tuple[str, ...] = ()
    parent_offsets: tuple[int, ...] = ()
    content_seed: bytes | None = None
    prefix: object | None = None  # engine.store.Message: the cached start it follows
    unrecorded: str = ""  # what shaped its KV beyond what its message records ("": nothing; engine.store.Message)
    status: CallStatus = CallStatus.ENCODING
    slots: list[int] = field(default_factory=list)
    # rows (token, position, call) fed a token it sampled, in order, while that token is not read yet: their token
    # is its place on the device until then (engine.scheduler.Request.feed)
    fed: deque = field(default_factory=deque)

    def start(self, eos_ids: tuple[int, ...], tokenizer, device: torch.device) -> None:
        """Its sampler and detokenizer (a decode call), made once when its request is built."""
        p = self.sampling
        if p is None:
            return
        self.stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
        self.generator = make_generator(p, device)
        self.detok = Detokenizer(tokenizer, p.stop)

    @property
    def decodes(self) -> bool:
        return self.sampling is not None

    @property
    def generated(self) -> list[int]:
        return self.detok.tokens if self.sampling is not None else []

    @property
    def all_tokens(self) -> list[int]:
        """Its tokens and what it sampled: all that gets KV, in order."""
        return self.tokens + self.generated if self.sampling is not None else self.tokens

    @property
    def reused(self) -> int:
        """Tokens of its message that came from the prefix cache (before `tokens`)."""
        return self.prefix.num_tokens if self.prefix is not None else 0

    @property
    def may_generate(self) -> int:
        """Tokens it may still sample."""
        return self.sampling.max_tokens - len(self.generated) if self.sampling is not None else 0

    @property
    def sampling_now(self) -> bool:
        """It samples a token from its last encoded row."""
        return self.status in (CallStatus.ENCODING, CallStatus.DECODING) and self.sampling is not None

    @property
    def samples_next(self) -> bool:
        """It samples from its next row's logits: it samples now, and its draws not read yet leave it tokens to
        sample (it may have stopped on one of them: that draw is then discarded)."""
        return self.sampling_now and len(self.generated) + len(self.fed) < self.sampling.max_tokens

    def rows(self) -> list[tuple[int, int]]:
        """(token, position) of everything it has, to encode from the start (first, or again after a preemption)."""
        return [(t, self.offset + i) for i, t in enumerate(self.all_tokens)]

    def sampled(self, token: int, index: int) -> TokenEvent:
        """Record a sampled token; its event (call `index` among the decode calls), the last one with a reason."""
        delta = self.detok.add(token)
        reason = None
        if token in self.stop_ids or self.detok.hit_stop(delta):
            reason = "stop"
        elif len(self.generated) == self.sampling.max_tokens:
            reason = "length"
        if reason is not None:
            delta += self.detok.flush()
            self.status = CallStatus.STOPPED if reason == "stop" else CallStatus.LENGTH
        else:
            self.status = CallStatus.DECODING
        return TokenEvent(index, token, delta, reason, self.message_id if reason else None)


# ---- what a caller asks for (Engine.prefill, Engine.decode_stream): planned into Calls by engine.planner ----------
@dataclass(frozen=True)
class KVTransform:
    """A request's KV seam (a cache mapper): `apply(message, kv)` maps the placed copy [L, 2, H, T, D] of each
    parent in `ids` (it may work in place: the copy is the engine's own) before the calls after its lead ones (its
    decode calls, or a prefill request's stored calls) attend to it. The lead calls read the same parents
    unmapped."""

    ids: frozenset[str]
    apply: Callable[[Message, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Sibling:
    """A parent that is prefill call `index` of the same request: encoded in the same forwards, before the
    decode calls that read it, at its own new_offset."""

    index: int


@dataclass
class PrefillCall:
    message: Tokens
    parents: Sequence[str | Sibling] = ()
    offsets: Sequence[int | None] | None = None  # None entries: directly after the previous parent
    new_offset: int | None = None  # None: directly after the last parent
    # False: encoded only for its request's decode calls to read (as a Sibling), never stored
    store: bool = True
    adapter: str | None = None  # the adapter its rows run on (Engine.add_adapter); None: the base weights
    # the id its message is stored under (None: a new one): a message encoded again from its record keeps its id
    id: str | None = None


@dataclass
class DecodeCall:
    header: Tokens  # non-empty: the first generated token is predicted from its last token
    parents: Sequence[str | Sibling] = ()
    offsets: Sequence[int | None] | None = None
    new_offset: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None  # its message is stored as encoded by "<fingerprint>+<adapter>"
