"""Forward passes over transformers' modules with a preallocated, segment-tagged KV cache.

One engine call gets one WorkCache: the placed context entries (copies of parent
messages, re-rotated to their offsets) first, then the tokens of every parallel
call, appended as they are encoded. Each slot carries a segment id: context entry
e has segment e, call c's own tokens have segment E + c. A query of call c may
attend slot s iff visible[c, segment[s]] and s <= its own slot, which gives the
choreography masks of parallel prefill (each message contiguous) and parallel
decode (tokens interleaved) from one rule.
"""

import torch

from braid.engine.attention import mask_needed
from braid.engine.model import LoadedModel


class WorkCache:
    """KV for one engine call. transformers calls `update` once per layer per forward."""

    def __init__(self, lm: LoadedModel, capacity: int):
        s = lm.spec
        self.kv = torch.empty(s.num_layers, 2, s.num_kv_heads, capacity, s.head_dim, dtype=lm.dtype, device=lm.device)
        self.segment = torch.empty(capacity, dtype=torch.long, device=lm.device)
        self.length = 0
        self._write = (0, 0)

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def append(self, kv: torch.Tensor, segment: int) -> None:
        """Copy an already-encoded block [L, 2, H, T, D] in as one segment."""
        start, end = self.length, self.length + kv.shape[3]
        self.kv[:, :, :, start:end] = kv
        self.segment[start:end] = segment
        self.length = end

    def reserve(self, segments: torch.Tensor) -> torch.Tensor:
        """Claim slots for the next forward's tokens; returns their slot indices."""
        start, end = self.length, self.length + segments.numel()
        self.segment[start:end] = segments
        self.length = end
        self._write = (start, end)
        return torch.arange(start, end, device=self.segment.device)

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        start, end = self._write
        self.kv[layer_idx, 0, :, start:end] = key_states[0]
        self.kv[layer_idx, 1, :, start:end] = value_states[0]
        return self.kv[layer_idx, 0, :, :end].unsqueeze(0), self.kv[layer_idx, 1, :, :end].unsqueeze(0)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The KV of the given slots as a contiguous block [L, 2, H, T, D]."""
        return self.kv.index_select(3, slots)


class ModelRunner:
    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.decoder = lm.model.model
        self.lm_head = lm.model.lm_head

    @torch.inference_mode()
    def forward(self, cache: WorkCache, visible: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                call_of_row: torch.Tensor, logit_rows: torch.Tensor | None) -> torch.Tensor | None:
        """Encode tokens (one row per token, any mix of calls); returns fp32 logits of `logit_rows`.

        visible: bool [calls, segments]; row r belongs to call call_of_row[r].
        """
        num_entries = visible.shape[1] - visible.shape[0]
        slots = cache.reserve(call_of_row + num_entries)
        plain_causal = visible.shape[0] == 1 and bool(visible.all())
        mask = None
        if mask_needed(self.lm.device, plain_causal, self.lm.dtype):
            keys = torch.arange(cache.length, device=slots.device)
            mask = visible[call_of_row][:, cache.segment[: cache.length]] & (keys[None, :] <= slots[:, None])
            mask = mask[None, None]
        out = self.decoder(input_ids=input_ids[None], position_ids=positions[None], attention_mask=mask,
                           past_key_values=cache, use_cache=True)
        if logit_rows is None:
            return None
        return self.lm_head(out.last_hidden_state[0, logit_rows]).float()
