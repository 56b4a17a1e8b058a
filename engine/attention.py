"""The one place that decides how attention runs.

The engine always hands transformers' modules an explicit attention mask, except
when a batch is plain causal attention over the whole cache (one call that sees
every context entry) and flash-attn is usable: then the mask is None and
flash-attn's bottom-right-aligned causal kernel runs. Everything else, CPU
included, runs SDPA with a boolean [1, 1, Q, K] mask (True = attend).

With `attention: flex` (EngineConfig) the engine's forwards read the KV pool in
place instead: each request's keys are the pool blocks of its page list, and
FlexAttention runs over the pool itself with a block mask built from those page
tables (`paged_mask`): no keys are gathered, and a block no request reads is never
touched. It is compiled on CUDA; on CPU it runs eagerly, which materialises the
scores over the window of blocks the requests' pages span, so there SDPA (over
gathered keys) stays the default and flex is the tested alternative: the same
masks, the same tokens (tests/engine/test_attention.py, tests/engine/test_scheduler.py).

On CUDA, masked queries of at most DECODE_ROWS rows (decode steps) skip SDPA's
cuDNN backend, which builds a graph for every new key length, and the key length
changes every decode step (benchmarks/profile_decode.py measures both). With GQA
and a mask no other fused kernel applies (flash takes no mask, the efficient kernel
no GQA), so those queries call SDPA's math kernel directly, which is where SDPA lands
with cuDNN switched off, without touching the process-wide backend switches that
another thread's attention would see. Longer queries keep SDPA's own choice: cuDNN
off for every forward slows long prefills several times over.

A compiled forward (EngineConfig.compile: engine.model_runner) reaches the same attention through one opaque op
per layer, `braid::step_attention`: torch.compile traces the decoder into one graph around those ops, and the op,
run as it is, writes the layer's new KV rows and runs `_per_request` over the forward's step, which it reads from
`forward_step` (a graph input cannot be a Python object).
"""

import contextlib
import threading
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask, sdpa_mask

from braid.engine.host import to_device

NAME = "braid"
# (on CPU, flex runs eagerly on purpose: module docstring)
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile", category=UserWarning)

try:  # optional extra `gpu`
    from flash_attn import flash_attn_func
except ImportError:  # pragma: no cover - depends on the install
    flash_attn_func = None


def use_flash(device: torch.device, dtype: torch.dtype) -> bool:
    return flash_attn_func is not None and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def mask_needed(device: torch.device, dtype: torch.dtype, plain: bool) -> bool:
    """False only when a request can go to flash-attn without a mask: plain causal attention over its whole cache
    (`plain`: one call that sees every entry, known on the host: RequestInput.plain)."""
    return not (use_flash(device, dtype) and plain)


DECODE_ROWS = 8  # masked queries of at most this many rows skip cuDNN on CUDA (module docstring)


def skips_cudnn(device_type: str, rows: int, masked: bool) -> bool:
    """Whether a query of `rows` rows on this device runs SDPA's math kernel directly (module docstring)."""
    return device_type == "cuda" and masked and rows <= DECODE_ROWS


def sdpa(query, key, value, attn_mask=None, scale=None, is_causal=False, enable_gqa=False,
         rows: int | None = None) -> torch.Tensor:
    """F.scaled_dot_product_attention (no dropout), with decode-sized masked queries on CUDA run by the math
    kernel, as SDPA runs them with cuDNN switched off. A boolean mask becomes additive first, as SDPA makes it
    (the result is bit-identical to SDPA's math backend). `rows`: the query rows that decide which (default:
    the query's own; decode_attention's rows are several heads' rows)."""
    if not skips_cudnn(query.device.type, query.shape[-2] if rows is None else rows, attn_mask is not None):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale,
                                              is_causal=is_causal, enable_gqa=enable_gqa)
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~attn_mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_attention_math(query, key, value, attn_mask, 0.0, is_causal, None,
                                                             scale=scale, enable_gqa=enable_gqa)[0]


def decode_attention(query, key, value, mask, scale) -> torch.Tensor:
    """The shared attention of decode-sized requests (engine.model_runner): queries [G, H, R, D] over keys and values
    [G, Hkv, T, D] with a mask [G, 1, R, T] (bool, or additive) -> [G, H, R, D]. The H / Hkv query heads that
    share a KV head go in as that head's rows, so the keys and values are read as they are; SDPA's GQA would
    repeat them for every query head first, which costs more than the attention itself at decode sizes."""
    g, h, r, d = query.shape
    n, t = h // key.shape[1], key.shape[2]
    if n > 1:
        query = query.reshape(g, key.shape[1], n * r, d)
        mask = mask[:, :, None].expand(g, 1, n, r, t).reshape(g, 1, n * r, t)
    return sdpa(query, key, value, attn_mask=mask, scale=scale, rows=r).reshape(g, h, r, d)


FLEX_Q_BLOCK = 128  # query rows per block of a paged block mask (the kernels' tile sizes divide it)


@dataclass(eq=False)
class PagedMask:
    """What G requests' query rows attend in the pool, built once a forward (`paged_mask`) and read by every layer:
    the pool slots [window] hold every key of every request, and the block mask says which each row attends."""

    block_mask: BlockMask
    window: slice  # pool slots: whole blocks, from the lowest block of any request's pages to the highest


def paged_mask(pages: list[list[int]], slots: torch.Tensor, inside: torch.Tensor | None, mask: torch.Tensor,
               block_tokens: int) -> PagedMask:
    """The block mask of G requests over the pool, from their page tables.

    pages: per request, the pool blocks that hold its keys, each once (more are harmless: a slot that is none of
    the request's keys is masked); slots: long [G, T], the pool slot of each request's key k (padding where `inside`
    [G, T] is false; None: none); mask: bool [G, R, T], row r of request g attends its key k. A slot maps to its key
    through two small tables (the block's place in the request's page table, the slot's key in that page), so the
    mask costs G * (blocks + pages * block_tokens) entries, not G * R * pool slots."""
    device, b = mask.device, block_tokens
    g, r, t = mask.shape
    lo = min(min(p) for p in pages if p)
    hi = max(max(p) for p in pages if p) + 1
    n, most = hi - lo, max(len(p) for p in pages)
    # host: each request's page table, relative to the window, and where each table entry goes in `page_of`
    table = [[x - lo for x in p] + [0] * (most - len(p)) for p in pages]
    flat = [i * n + x - lo for i, p in enumerate(pages) for x in p]
    pos = [k for p in pages for k in range(len(p))]
    host = to_device(table, device, torch.int32)  # [G, most]
    page_of = torch.full((g * n,), most, dtype=torch.int32, device=device)  # most: not one of the request's pages
    page_of[to_device(flat, device)] = to_device(pos, device, torch.int32)
    page_of = page_of.view(g, n)
    keypos = torch.full((g, most + 1, b), t, dtype=torch.int32, device=device)  # t: none of the request's keys
    rel = slots - lo * b
    request = torch.arange(g, device=device)[:, None].expand(g, t)
    page = page_of[request, (rel // b).clamp(0, n - 1)].long()
    if inside is not None:  # (padding keys go to the spare row, refilled below)
        page = torch.where(inside, page, most)
    keypos[request, page, rel % b] = torch.arange(t, dtype=torch.int32, device=device).expand(g, t)
    keypos[:, most] = t
    allowed = F.pad(mask, (0, 1))  # [G, R, T + 1]: key t is no key

    def mask_mod(bi, h, q, kv):
        return allowed[bi, q, keypos[bi, page_of[bi, kv // b], kv % b]]

    q_blocks = -(-r // FLEX_Q_BLOCK)
    counts = to_device([len(p) for p in pages], device, torch.int32)
    kv_indices = torch.zeros(g, 1, q_blocks, n, dtype=torch.int32, device=device)
    kv_indices[:, 0, :, :most] = host[:, None]
    block_mask = BlockMask.from_kv_blocks(counts.view(g, 1, 1).expand(g, 1, q_blocks).contiguous(), kv_indices,
                                          BLOCK_SIZE=(FLEX_Q_BLOCK, b), mask_mod=mask_mod, seq_lengths=(r, n * b),
                                          compute_q_blocks=False)
    return PagedMask(block_mask, slice(lo * b, hi * b))


_compiled_flex = None


def paged_attention(query: torch.Tensor, kv: torch.Tensor, paged: PagedMask, scale) -> torch.Tensor:
    """Queries [G, H, R, D] over one layer of the pool, kv [2, Hkv, slots, D], in place -> [G, H, R, D]."""
    global _compiled_flex
    k, v = kv[0, :, paged.window][None], kv[1, :, paged.window][None]  # [1, Hkv, window, D]: views
    run = flex_attention
    if query.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        run = _compiled_flex
    # (the compiled kernel's KV tile must divide the pool's block: a smaller tile where the block is under the default)
    b = paged.block_mask.BLOCK_SIZE[1]
    options = {"BLOCK_N": b, "BLOCK_M": 64} if query.device.type == "cuda" and b < 64 else None
    return run(query, k, v, block_mask=paged.block_mask, scale=scale, enable_gqa=query.shape[1] != kv.shape[1],
               kernel_options=options)


IN_GRAPH = "braid-step-in-graph"  # the braid_step of a compiled forward: its step is `forward_step`'s
_forward = threading.local()  # (each engine's forwards run on its scheduler's thread)


@contextlib.contextmanager
def forward_step(step):
    """Make `step` (engine.model_runner._Step) the one this thread's compiled forward attends through."""
    _forward.step, _forward.ran = step, False
    try:
        yield
    finally:
        _forward.step = None


def forward_ran() -> bool:
    """Whether this thread's last compiled forward reached an attention op (so it was compiled, and ran)."""
    return getattr(_forward, "ran", False)


@torch.library.custom_op("braid::step_attention", mutates_args=())
def step_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
                   scale: float) -> torch.Tensor:
    """One layer's attention in a compiled forward: the new rows' keys and values [1, Hkv, N, D] written to their
    requests' caches, then every request's attention over its own, as a forward run as it comes does it: queries
    [1, H, N, D] -> [1, N, H, D]. Opaque to torch.compile, which fuses what lies between these ops; it writes the
    KV pool, which no op of the graph reads, layer `layer`'s part of it only."""
    step, _forward.ran = _forward.step, True
    step.update(key, value, layer)
    return _per_request(layer, query, step, scale, 0.0).contiguous()


@step_attention.register_fake
def _(query, key, value, layer, scale):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, braid_step=None,
                      **kwargs):
    """transformers attention interface: q [B,H,Q,D], k/v [B,Hkv,K,D] -> ([B,Q,H,D], None).

    `braid_step` (engine.model_runner): the forward holds rows of several engine calls; each attends its own cache
    with its own mask, and `key`/`value` (this forward's new rows) are already in those caches; IN_GRAPH: the same
    in a compiled forward, where `key`/`value` are not written yet (step_attention writes them)."""
    if braid_step is not None:
        if isinstance(braid_step, str) and braid_step == IN_GRAPH:
            return torch.ops.braid.step_attention(query, key, value, module.layer_idx, scaling), None
        return _per_request(module.layer_idx, query, braid_step, scaling, dropout), None
    if attention_mask is None and use_flash(query.device, query.dtype):
        out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                              softmax_scale=scaling, causal=True)
        return out, None
    # A None mask here comes from transformers' own mask builder (plain `generate`), which
    # only omits it where SDPA's top-left causal flag is right.
    out = sdpa(query, key, value, attn_mask=attention_mask, scale=scaling,
               is_causal=attention_mask is None and query.shape[2] > 1, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, attention_forward)
# So the model also runs outside the engine (e.g. `generate`), with the mask its backend expects.
AttentionMaskInterface.register(NAME, flash_attention_mask if flash_attn_func is not None else sdpa_mask)


def _per_request(layer, query, step, scaling, dropout) -> torch.Tensor:
    """Attention of one forward over several requests' caches, at layer `layer`: [1, H, N, D] queries ->
    [1, N, H, D]."""
    _, h, n, d = query.shape
    out = None if step.padded else query.new_empty(n, h, d)
    if step.paged is not None:
        return _per_request_in_place(query, step, layer, scaling, out)
    for part in step.large:
        rows, mask, r = part.rows, part.mask, part.lead
        if r:  # leading prefill calls' rows first: they attend [0, their last token), the rest [start, length)
            end = part.lead_end  # (not the slots claimed for leading prefill tokens of later forwards: not written yet)
            first = slice(rows.start, rows.start + r)
            k, v = part.layer_kv(layer, 0, end)
            out[first] = attention_forward(None, query[:, :, first], k, v, mask[:, :, :r, :end], scaling,
                                           dropout)[0][0]
            rows, mask = slice(first.stop, rows.stop), mask[:, :, r:, part.start:]
            if rows.start == rows.stop:
                continue
        k, v = part.layer_kv(layer, part.start, part.cache.length)
        out[rows] = attention_forward(None, query[:, :, rows], k, v, mask, scaling, dropout)[0][0]
    if step.small:
        g, r, _ = step.shape
        q = query[0] if step.padded else query[0].index_select(1, step.row_index)
        q = q.view(h, g, r, d).transpose(0, 1)  # [G, H, R, D]
        if step.paged_decode is not None:  # (the pool read where the keys lie, through their slots: nothing gathered)
            seen = step.allowed if step.padded else step.mask
            o = step.paged_decode(q, step.pool.kv[layer], step.read_index.view(g, -1), seen, scaling)
        else:
            k, v = step.shared_kv(layer)
            o = decode_attention(q, k, v, step.mask, scaling)
        o = o.transpose(1, 2).reshape(g * r, h, d)
        if step.padded:  # (engine.cuda_graphs: the forward's rows are the padded rows)
            return o[None]
        out.index_copy_(0, step.rows, o.index_select(0, step.valid))
    return out[None]


def _per_request_in_place(query, step, layer, scaling, out) -> torch.Tensor:
    """`_per_request` with `attention: flex`: every request reads its keys where they lie in the pool (step.paged: one
    PagedMask for each large request, then one for the shared ones)."""
    _, h, n, d = query.shape
    kv = step.pool.kv[layer]
    masks = iter(step.paged)
    for part in step.large:
        q = query[:, :, part.rows]  # [1, H, rows, D]
        out[part.rows] = paged_attention(q, kv, next(masks), scaling)[0].transpose(0, 1)
    if step.small:
        g, r, _ = step.shape
        q = query[0].index_select(1, step.row_index).view(h, g, r, d).transpose(0, 1)  # [G, H, R, D]
        o = paged_attention(q, kv, next(masks), scaling).transpose(1, 2).reshape(g * r, h, d)
        out.index_copy_(0, step.rows, o.index_select(0, step.valid))
    return out[None]
