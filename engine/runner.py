"""Forward passes over transformers' modules with a preallocated, segment-tagged KV cache.

One engine call gets one WorkCache: the placed context entries (copies of parent
messages, re-rotated to their offsets) first, then the tokens of every parallel
call, appended as they are encoded. Each slot carries a segment id: context entry
e has segment e, call c's own tokens have segment E + c. A query of call c may
attend slot s iff visible[c, segment[s]] and s <= its own slot, which gives the
choreography masks of parallel prefill (each message contiguous) and parallel
decode (tokens interleaved) from one rule.
"""

from dataclasses import dataclass

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

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def append(self, kv: torch.Tensor, segment: int) -> None:
        """Copy an already-encoded block [L, 2, H, T, D] in as one segment."""
        start, end = self.length, self.length + kv.shape[3]
        self.kv[:, :, :, start:end] = kv
        self.segment[start:end] = segment
        self.length = end

    def reserve(self, segments: torch.Tensor) -> slice:
        """Claim slots for the next forward's tokens; returns their (contiguous) range."""
        start, end = self.length, self.length + segments.numel()
        self.segment[start:end] = segments
        self.length = end
        return slice(start, end)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The KV of the given slots as a contiguous block [L, 2, H, T, D]."""
        return self.kv.index_select(3, slots)


@dataclass
class GroupInput:
    """One engine call's rows in a forward: its own work cache, masks and tokens.

    visible: bool [calls, segments]; row r belongs to call call_of_row[r]; logit_rows: which of its rows
    need next-token logits (None: none)."""

    cache: WorkCache
    visible: torch.Tensor
    input_ids: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    call_of_row: torch.Tensor  # [rows]
    logit_rows: torch.Tensor | None


@dataclass
class _Part:
    """A group's place in one forward, for the cache writes and the attention (engine.attention)."""

    cache: WorkCache
    rows: slice  # its rows among the forward's
    slots: slice  # where its rows' KV go in its cache
    mask: torch.Tensor | None  # bool [1, 1, rows, cache.length]; None: plain causal, flash-attn

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values of the group's whole cache, new rows included: [1, H, T, D] each."""
        end = self.cache.length
        return self.cache.kv[layer, 0, :, :end][None], self.cache.kv[layer, 1, :, :end][None]


SHARED_ATTENTION_ROWS = 8  # groups with at most this many rows in a forward (decoding) share one attention call


class _Step:
    """One forward's groups, as the attention reads them: groups with many rows (prefill chunks) attend one by
    one; the others (decode steps) in one padded batch, their keys padded to the longest cache and masked."""

    def __init__(self, parts: list[_Part]):
        small = [p for p in parts if p.rows.stop - p.rows.start <= SHARED_ATTENTION_ROWS and p.mask is not None]
        self.small = small if len(small) > 1 else []
        self.large = [p for p in parts if not any(p is q for q in self.small)]
        if not self.small:
            return
        device = small[0].mask.device
        g, r, t = len(small), max(p.rows.stop - p.rows.start for p in small), max(p.cache.length for p in small)
        row_index = torch.zeros(g, r, dtype=torch.long)
        valid = torch.zeros(g, r, dtype=torch.bool)
        mask = torch.zeros(g, 1, r, t, dtype=torch.bool, device=device)
        mask[:, :, :, 0] = True  # (padding rows see one key, so they stay finite; they are dropped)
        for i, p in enumerate(small):
            n = p.rows.stop - p.rows.start
            row_index[i, :n] = torch.arange(p.rows.start, p.rows.stop)
            valid[i, :n] = True
            mask[i, 0, :n] = False
            mask[i, 0, :n, :p.cache.length] = p.mask[0, 0]
        self.shape = (g, r, t)
        self.row_index = row_index.flatten().to(device)  # [g * r]: each padded query row's row in the forward
        self.valid = valid.flatten().nonzero().squeeze(1).to(device)  # which padded rows are real
        self.rows = row_index[valid].to(device)  # and their rows in the forward, in the same order
        self.mask = mask

    def shared_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the shared-attention groups, padded: [groups, H, longest cache, D] each."""
        pad = torch.nn.utils.rnn.pad_sequence
        kv = [p.cache.kv[layer, :, :, :p.cache.length].permute(2, 0, 1, 3) for p in self.small]  # [T, 2, H, D]
        both = pad(kv, batch_first=True)  # [G, T, 2, H, D]
        return both[:, :, 0].transpose(1, 2), both[:, :, 1].transpose(1, 2)


class _StepCache:
    """transformers' cache seam for one forward over several groups: each layer's new K/V rows go to the
    work cache of the group they belong to; attention then reads each group's own cache."""

    def __init__(self, parts: list[_Part]):
        self.parts = parts

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        for p in self.parts:  # (a group's new slots are contiguous: WorkCache.reserve)
            p.cache.kv[layer_idx, :, :, p.slots] = torch.stack([key_states[0, :, p.rows], value_states[0, :, p.rows]])
        return key_states, value_states


class ModelRunner:
    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.decoder = lm.model.model
        self.lm_head = lm.model.lm_head

    def forward(self, cache: WorkCache, visible: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                call_of_row: torch.Tensor, logit_rows: torch.Tensor | None) -> torch.Tensor | None:
        """One group alone: `step` with one input."""
        return self.step([GroupInput(cache, visible, input_ids, positions, call_of_row, logit_rows)])[0]

    @torch.inference_mode()
    def step(self, groups: list[GroupInput]) -> list[torch.Tensor | None]:
        """Encode every group's rows in one forward (linear layers batched over all rows, attention per group
        over its own cache); returns each group's fp32 logits of its `logit_rows`."""
        parts, start = [], 0
        for g in groups:
            num_entries = g.visible.shape[1] - g.visible.shape[0]
            slots = g.cache.reserve(g.call_of_row + num_entries)  # a contiguous range
            plain_causal = g.visible.shape[0] == 1 and bool(g.visible.all())
            mask = None
            if len(groups) > 1 or mask_needed(self.lm.device, plain_causal, self.lm.dtype):
                keys = torch.arange(g.cache.length, device=g.visible.device)
                own = torch.arange(slots.start, slots.stop, device=g.visible.device)
                mask = g.visible[g.call_of_row][:, g.cache.segment[: g.cache.length]] & (keys[None, :] <= own[:, None])
                mask = mask[None, None]
            rows = slice(start, start + len(g.input_ids))
            parts.append(_Part(g.cache, rows, slots, mask))
            start = rows.stop
        input_ids = torch.cat([g.input_ids for g in groups])[None]
        positions = torch.cat([g.positions for g in groups])[None]
        placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=input_ids.device)  # (masks are per part)
        out = self.decoder(input_ids=input_ids, position_ids=positions, attention_mask=placeholder,
                           past_key_values=_StepCache(parts), use_cache=True, braid_step=_Step(parts))
        hidden = out.last_hidden_state[0]
        return [None if g.logit_rows is None else self.lm_head(hidden[p.rows][g.logit_rows]).float()
                for g, p in zip(groups, parts)]
