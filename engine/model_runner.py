"""Forward passes over transformers' modules, reading paged, segment-tagged work caches (engine.kv_cache).

The runner is handed a step: each request's rows, their slots in its work cache (claimed by the scheduler,
engine.kv_cache.RowSlots) and its visibility matrix. It builds each request's mask from those, writes the rows'
KV to the pool slots it was given and attends over the cache; it allocates nothing and writes nothing back into
its input.
"""

import contextlib
import logging
from dataclasses import dataclass

import torch

from braid.engine.attention import IN_GRAPH, forward_ran, forward_step, mask_needed, paged_mask
from braid.engine.host import to_device
from braid.engine.kv_cache import RowSlots, WorkCache
from braid.engine.model import LoadedModel

log = logging.getLogger(__name__)
# what torch.compile raises when it cannot compile (a graph break under fullgraph, a failed backend, a guard that
# would recompile past the limit): the compiled forward then never started
COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException,
                  *((torch._dynamo.exc.FailOnRecompileLimitHit,)
                    if hasattr(torch._dynamo.exc, "FailOnRecompileLimitHit") else ()))


@dataclass
class RequestInput:
    """One engine call's rows in a forward: its own work cache, masks and tokens, and where the rows go.

    visible: bool [calls, segments]; row r belongs to call call_of_row[r]; logit_rows: which of its rows
    need next-token logits (None: none); slots: their slots in the cache, claimed by whoever built the step
    (WorkCache.claim), the leading prefill calls' rows first."""

    cache: WorkCache
    visible: torch.Tensor
    input_ids: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    call_of_row: torch.Tensor  # [rows]
    logit_rows: list[int] | None  # (host indices: one copy for all the requests of a forward)
    slots: RowSlots
    # one call that sees every entry of its cache (visible all true): a single row of it attends every key before
    # it, so its mask need not be built (Request.plain)
    plain: bool = False

    @property
    def lead_rows(self) -> int:
        """How many of the rows (the first) are leading prefill calls' tokens."""
        return len(self.slots.lead)


@dataclass
class _Part:
    """A request's place in one forward, for the cache writes and the attention (engine.attention). Its first
    `lead` rows (leading prefill calls' tokens) attend slots [0, lead_end); the others [start, length)."""

    cache: WorkCache
    rows: slice  # its rows among the forward's
    write_index: torch.Tensor  # where its rows' KV go in the pool: [rows]
    mask: torch.Tensor | None  # bool [1, 1, rows, keys]: keys [0, length) with lead rows, else [start, length)
    lead: int = 0  # its first rows that are leading prefill calls' tokens
    lead_end: int = 0  # one past the last of those rows' slots: they attend [0, lead_end), all written
    full: bool = False  # one row that attends every key [start, length): `mask` is None and not needed

    @property
    def masked(self) -> bool:
        """It has a mask, or needs none because it sees every key (`full`): what the shared attention takes."""
        return self.mask is not None or self.full

    @property
    def start(self) -> int:
        return self.cache.start

    def layer_kv(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values of its cache's slots [start, end), new rows included: [1, H, T, D] each."""
        kv = self.cache.layer_kv(layer, start, end)
        return kv[0][None], kv[1][None]


def padded_keys(parts: list[_Part], t: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool slots of each part's keys [start, length), padded to t with slot `pad`: ([len(parts) * t] long,
    bool [len(parts), t] where a key is a real one). A few ops for all the parts, none per part, and no read back
    to the host (where the keys go is computed from host lengths)."""
    device = parts[0].cache.index.device
    lengths = [p.cache.length - p.start for p in parts]
    firsts = [0]
    for n in lengths[:-1]:
        firsts.append(firsts[-1] + n)
    # key k of part i (k < its length) goes to i * t + k; it is key firsts[i] + k of the parts' keys laid end to end
    host = to_device([lengths, [i * t - f for i, f in enumerate(firsts)]], device)
    total = firsts[-1] + lengths[-1]
    where = torch.arange(total, device=device) + torch.repeat_interleave(host[1], host[0], output_size=total)
    index = torch.full((len(parts) * t,), pad, dtype=torch.long, device=device)
    index.index_copy_(0, where, torch.cat([p.cache.index[p.start:p.cache.length] for p in parts]))
    return index, torch.arange(t, device=device)[None, :] < host[0][:, None]


def fill_masks(mask: torch.Tensor, parts: list[_Part], inside: torch.Tensor) -> None:
    """The padded masks of the shared decode attention, bool [>= len(parts), 1, R, T]: every row of part i sees
    its keys (`inside` [len(parts), T], from padded_keys), so padding rows, which are dropped, stay finite and a
    `full` part's row needs nothing more; the real rows of a part with a mask of its own take it."""
    mask[:len(parts)] = inside[:, None, None, :]
    for i, p in enumerate(parts):
        if not p.full:
            mask[i, 0, :p.rows.stop - p.rows.start, :p.cache.length - p.start] = p.mask[0, 0]


SHARED_ATTENTION_ROWS = 8  # requests with at most this many rows in a forward (decoding) share one attention call


class _Step:
    """One forward's requests, as the cache writes and the attention use them. Every new row's KV goes to its
    request's blocks in the pool in one indexed write per layer. Requests with many rows (prefill chunks)
    attend their own cache one by one; the others (decode steps) share one padded attention call, their
    caches read from the pool in one indexed gather per layer, padded to the longest and masked. `in_place`
    (attention: flex): nothing is gathered; each request's attention reads the pool where its keys lie, through a
    block mask built here from its page table, once for all the layers (`paged`)."""

    padded = False  # (engine.cuda_graphs.PaddedStep: every row of the forward is a padded row of the shared call)
    paged = None  # list[engine.attention.PagedMask]: one per large request, then one for the shared ones (in_place)
    # (attention: paged) the kernel by which the shared decode attention reads the pool in place through `read_index`
    # (kernels.paged_decode.paged_decode_attention); None: the keys gathered for SDPA
    paged_decode = None

    def __init__(self, parts: list[_Part], in_place: bool = False, paged_decode=None):
        self.parts, self.paged_decode = parts, paged_decode
        self.pool = parts[0].cache.pool  # (every call's cache is in the engine's one pool)
        device = self.pool.kv.device
        self.write_index = torch.cat([p.write_index for p in parts])  # where each row's KV goes: [rows]
        small = [p for p in parts if p.rows.stop - p.rows.start <= SHARED_ATTENTION_ROWS and p.masked
                 and not p.lead]
        self.small = small if len(small) > 1 else []
        self.large = [p for p in parts if not any(p is q for q in self.small)]
        for p in self.large:
            if p.full:  # (one request alone: its explicit mask, every key, as SDPA was always given)
                p.mask = torch.ones(1, 1, 1, p.cache.length - p.start, dtype=torch.bool, device=device)
        b = self.pool.block_tokens
        if in_place:  # (each large request's keys: [0, length) with leading prefill rows, else [start, length))
            keys = [p.cache.index[0 if p.lead else p.start:p.cache.length][None] for p in self.large]
            self.paged = [paged_mask([list(p.cache.pages)], k, None, p.mask[:, 0], b) for p, k in zip(self.large, keys)]
        if not self.small:
            return
        counts = [p.rows.stop - p.rows.start for p in small]
        g, r, t = len(small), max(counts), max(p.cache.length - p.start for p in small)
        # the padded query rows, built on the host and copied once: request i's n rows at [i * r, i * r + n)
        row_index, valid, rows = [0] * (g * r), [], []
        for i, (p, n) in enumerate(zip(small, counts)):
            row_index[i * r:i * r + n] = range(p.rows.start, p.rows.stop)
            valid.extend(range(i * r, i * r + n))
            rows.extend(range(p.rows.start, p.rows.stop))
        self.shape = (g, r, t)
        self.row_index = to_device(row_index, device)  # [g * r]: each padded query row's row in the forward
        self.valid = to_device(valid, device)  # which padded rows are real
        self.rows = to_device(rows, device)  # and their rows in the forward, in the same order
        self.read_index, inside = padded_keys(small, t, self.pool.trash)  # [g * t]; bool [g, t]
        self.mask = torch.empty(g, 1, r, t, dtype=torch.bool, device=device)
        fill_masks(self.mask, small, inside)
        if in_place:
            self.paged.append(paged_mask([list(p.cache.pages) for p in small], self.read_index.view(g, t), inside,
                                         self.mask[:, 0], b))

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        """transformers' cache seam: this forward's new K/V rows ([1, H, rows, D] each) go to their requests'
        caches; attention then reads each request's own cache (engine.attention)."""
        self.pool.kv[layer_idx, 0].index_copy_(1, self.write_index, key_states[0])
        self.pool.kv[layer_idx, 1].index_copy_(1, self.write_index, value_states[0])
        return key_states, value_states

    def shared_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the shared-attention requests, padded: [requests, H, longest cache, D] each."""
        g, _, t = self.shape
        kv = self.pool.kv[layer].index_select(2, self.read_index)  # [2, H, g * t, D]
        kv = kv.view(2, kv.shape[1], g, t, kv.shape[3]).transpose(1, 2)  # [2, g, H, t, D]
        return kv[0], kv[1]


RECOMPILE_LIMIT = 64  # graphs torch.compile keeps for the decoder's code: each engine's weights add one or two


@contextlib.contextmanager
def _compiling():
    """torch.compile's settings for a compiled forward, as this thread's own (torch keeps a patch per thread):
    - a debug check off, which runs a compiled graph's first call under a dispatch mode of its own, in which
      FlexAttention's eager mask, inside the attention op, cannot be built;
    - more graphs kept per code object: the decoder's code is every engine's in the process, and each engine's weights
      are graphs of their own (torch's default, 8, would leave a process's ninth one uncompiled)."""
    with torch._functorch.config.patch(check_custom_op_aliasing=False), \
            torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        yield


class ModelRunner:
    def __init__(self, lm: LoadedModel, attention: str = "sdpa", compile: bool = False):
        """`attention`: "sdpa" (keys gathered out of the pool), "flex" (read in place: _Step's `in_place`) or
        "paged" (as sdpa, the shared decode attention reading the pool in place: _Step's `paged_decode`).
        `compile`: base-weight forwards run the decoder through torch.compile (EngineConfig.compile)."""
        self.lm = lm
        self.in_place = attention == "flex"
        self.paged_decode = None  # (attention: paged) the shared decode attention's kernel: _Step's `paged_decode`
        if attention == "paged":
            from braid.kernels.paged_decode import paged_decode_attention  # (Triton: imported only where it runs)

            self.paged_decode = paged_decode_attention
        self.decoder = lm.model.model
        self.lm_head = lm.model.lm_head
        self.graphs = None  # engine.cuda_graphs.DecodeGraphs (set by the engine), or None: every forward as it comes
        self.compiled = self.compiled_decoder() if compile else None
        self.compiled_forwards = 0  # forwards that ran compiled

    def compiled_decoder(self):
        """The decoder through torch.compile (compiled at its first forward): one graph for every forward's rows
        (dynamic), attention an opaque op per layer (attention.step_attention); fullgraph, so that a model whose
        graph would break runs as it comes instead (`forward`)."""
        return torch.compile(self.decoder, dynamic=True, fullgraph=True)

    @torch.inference_mode()
    def step(self, requests: list[RequestInput], weights=None) -> list[torch.Tensor | None]:
        """Encode every request's rows in one forward (linear layers batched over all rows, attention per request
        over its own cache); returns each request's fp32 logits of its `logit_rows`. A forward of decode-sized
        requests runs at a static shape when the runner has graphs (engine.cuda_graphs). `weights` names the weights
        in place for this forward when they are not the base ones (the scheduler's adapter; in a static
        forward, which has no leading prefill rows, it is in place over every row): a graph replays the weights it
        was captured with, so each has its own."""
        graphs = self.graphs  # (read once)
        shape = graphs.shape(requests) if graphs is not None else None
        parts, start = [], 0
        for g in requests:
            part = self._part(g, start, masked=shape is not None or len(requests) > 1 or self.in_place)
            parts.append(part)
            start = part.rows.stop
        if shape is not None:
            hidden = graphs.run(requests, parts, shape, weights)  # [G * R, hidden]: request i's rows from i * R
            if hidden is not None:
                r = shape[1]
                return self._logits(requests, hidden, [slice(i * r, i * r + len(g.input_ids))
                                                     for i, g in enumerate(requests)])
        input_ids = torch.cat([g.input_ids for g in requests])[None]
        positions = torch.cat([g.positions for g in requests])[None]
        hidden = self.forward(input_ids, positions, _Step(parts, self.in_place, self.paged_decode), weights)
        return self._logits(requests, hidden, [p.rows for p in parts])

    def _logits(self, requests: list[RequestInput], hidden: torch.Tensor,
                rows: list[slice]) -> list[torch.Tensor | None]:
        """Each request's fp32 logits of its `logit_rows`, its rows being `rows[i]` of `hidden`: one lm_head over
        every request's rows (its weight read once a forward, not once a request)."""
        wanted = [g.logit_rows for g in requests if g.logit_rows is not None]
        if not wanted:
            return [None] * len(requests)
        index = to_device([i + r.start for g, r in zip(requests, rows) if g.logit_rows is not None
                           for i in g.logit_rows], hidden.device)
        logits = iter(self.lm_head(hidden.index_select(0, index)).float().split([len(w) for w in wanted]))
        return [None if g.logit_rows is None else next(logits) for g in requests]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: "_Step", weights=None) -> torch.Tensor:
        """The decoder over one forward's rows ([1, rows] ids and positions): last hidden states [rows, hidden].
        Compiled where the runner compiles and the base weights are in place (`weights` None: an adapter's swap
        would be another graph's worth of guards)."""
        placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=input_ids.device)  # (masks are per part)
        if self.compiled is not None and weights is None:
            if not self.compiled_forwards:
                log.info("compiling the decoder: its first forwards take seconds to minutes")
            try:
                with forward_step(step), _compiling():
                    out = self.compiled(input_ids=input_ids, position_ids=positions, attention_mask=placeholder,
                                        use_cache=False, braid_step=IN_GRAPH)
                self.compiled_forwards += 1
                return out.last_hidden_state[0]
            except COMPILE_ERRORS:
                if forward_ran():  # (it compiled, and failed as it ran: a forward's failure, its requests' to hear)
                    raise
                log.exception("compiling the decoder failed; its forwards run as they come")
                self.compiled = None
        out = self.decoder(input_ids=input_ids, position_ids=positions, attention_mask=placeholder,
                           past_key_values=step, use_cache=True, braid_step=step)
        return out.last_hidden_state[0]

    def _part(self, g: RequestInput, start: int, masked: bool) -> _Part:
        """The request's place in a forward whose rows so far end at `start`: where its rows' KV go (its slots, as
        claimed) and its mask, unless it needs none (one plain-causal request on flash-attn, and `masked` false; or
        one row of a `plain` request, which sees every key: `full`)."""
        r, cache, slots = g.lead_rows, g.cache, g.slots
        mask, full = None, False
        if masked or mask_needed(self.lm.device, self.lm.dtype, g.plain):
            if g.plain and not r and len(g.input_ids) == 1:
                full = True
            else:
                lo = 0 if r else cache.start
                keys = torch.arange(lo, slots.length, device=g.visible.device)
                mask = g.visible[g.call_of_row][:, cache.segment[lo:slots.length]] & (
                    keys[None, :] <= slots.logical[:, None])
                mask = mask[None, None]
        rows = slice(start, start + len(g.input_ids))
        return _Part(cache, rows, slots.write, mask, r, slots.lead.stop if r else 0, full)
