"""Sampling parameters and the per-step sampler."""

from dataclasses import dataclass

import torch

from braid.engine.host import ToHost


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (0 <= self.temperature < float("inf")):  # also refuses NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One sampled token id (0-d tensor, on the logits' device: nothing read on the host) from fp32 logits [vocab]
    at params' temperature and top_p; -1 where the logits are not finite (the caller fails the call). An
    exponential race, argmax(probs / E) with E ~ Exp(1) drawn from the call's generator, is exact sampling from
    probs without torch.multinomial, which waits on the device."""
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)  # (no overflow however small)
    order = None
    if params.top_p < 1:
        probs, order = probs.sort(descending=True)
        probs = probs * (probs.cumsum(-1) - probs < params.top_p)  # (always keeps the top token)
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    choice = (probs / race).argmax(dim=-1, keepdim=True)  # [1]
    token = choice if order is None else order.gather(-1, choice)  # (a tensor index: indexing with it would read it)
    return torch.where(torch.isfinite(logits).all(), token, -1)[0]


def pick(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
         ) -> torch.Tensor:
    """A request's next tokens [rows] on the device (nothing read): row r of `logits` [rows, vocab] its argmax, or
    drawn with params[r] and generators[r] (`draw`)."""
    top = logits.argmax(dim=-1)
    for r, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature > 0:
            top[r] = draw(logits[r], p, gen)
    return top


class Picked:
    """A step's picked tokens (`pick`, one tensor per request; None: the request samples nothing this step), together
    on the device as `tokens` (flat, request i's from `starts[i]`: what the next step's rows read when it is built
    before these are read, Scheduler `overlap`) and on their way to the host, where `read` gets them all at once:
    one device read for the whole step."""

    def __init__(self, picks: list[torch.Tensor | None]):
        present = [x for x in picks if x is not None]
        self.sizes = [None if x is None else x.shape[0] for x in picks]
        self.starts, at = [], 0
        for n in self.sizes:
            self.starts.append(at)
            at += n or 0
        self.tokens = (torch.cat(present) if len(present) > 1 else present[0]) if present else None
        self._host = ToHost(self.tokens) if self.tokens is not None else None

    def read(self) -> list[list[int] | None]:
        """Each request's tokens (None where it sampled nothing); a sampled token is drawn once, however read."""
        flat = self._host.values() if self._host is not None else []
        return [None if n is None else flat[s:s + n] for s, n in zip(self.starts, self.sizes)]
