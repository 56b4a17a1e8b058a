"""Sampling parameters and the per-step sampler."""

from dataclasses import dataclass

import torch


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


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token id (0-d tensor) from fp32 logits [vocab]."""
    if params.temperature == 0:
        return logits.argmax()
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < params.top_p  # always keeps the top token
        sorted_probs = sorted_probs * keep
        return order[torch.multinomial(sorted_probs, 1, generator=generator)[0]]
    return torch.multinomial(probs, 1, generator=generator)[0]


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators,
                greedy: list[int] | None = None) -> list[int]:
    """One token per row of fp32 logits [rows, vocab], row i sampled with params[i]. `greedy`: the rows' argmax,
    when the caller has read them already (greedy_rows)."""
    if greedy is None:
        greedy = logits.argmax(dim=-1).tolist()  # one sync for every greedy call
    return [g if p.temperature == 0 else int(sample(logits[i], p, gen))
            for i, (g, p, gen) in enumerate(zip(greedy, params, generators))]


def greedy_rows(logits: list[torch.Tensor | None]) -> list[list[int] | None]:
    """The argmax of every row of every group's logits ([rows, vocab] each, or None), read in one device sync for
    the whole step, not one per group."""
    present = [x for x in logits if x is not None]
    if not present:
        return [None] * len(logits)
    flat = iter((torch.cat(present) if len(present) > 1 else present[0]).argmax(dim=-1).tolist())
    return [None if x is None else [next(flat) for _ in range(x.shape[0])] for x in logits]
