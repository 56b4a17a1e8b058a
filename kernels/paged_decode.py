"""Decode attention over the KV pool in place: a Triton kernel that reads each request's keys through its slot table.

The shared decode attention (engine.attention, `attention: paged`) gives G decode-sized requests, each of at most R
query rows, one call: queries [G, H, R, D] attend the keys and values of the pool [2, Hkv, slots, D] whose slots
`slots` [G, T] name (key t of request g), under a mask [G, 1, R, T]. The gathered path copies those keys out of the
pool first and runs SDPA's math kernel on the copy (fp32 scores, in a tensor of their own). Here each program
loads a request's keys straight from the pool, BLOCK_N slots at a time, and keeps the softmax online (running
maximum and sum in fp32, as FlashAttention does), so nothing is gathered or materialised and the inputs stay in
the pool's dtype (bf16 on a GPU). Every shape is fixed by the step's buffers and nothing reads back to the host, so
a CUDA graph captures it (engine.cuda_graphs).

The H / Hkv query heads that share a KV head go in as that head's rows: one program per (request, KV head) reads
its keys once for all of them (row m of the program is query head m // R of the group, row m % R).

On CPU, Triton runs only under its interpreter (TRITON_INTERPRET=1, set before triton is imported); the tests use
it to check this kernel against SDPA over gathered keys.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr, kv_ptr, slots_ptr, mask_ptr, out_ptr, scale, T,
    stride_kv_side, stride_kv_head, stride_kv_slot,
    H: tl.constexpr, HKV: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)  # the request
    hk = tl.program_id(1).to(tl.int64)  # its KV head
    n = H // HKV  # query heads per KV head
    m = tl.arange(0, BLOCK_M)  # the program's rows: query head hk * n + m // R, row m % R
    d = tl.arange(0, BLOCK_D)
    m_ok = m < n * R
    d_ok = d < D
    head = hk * n + m // R
    row = m % R
    q_off = ((g * H + head) * R + row)[:, None] * D + d[None, :]  # q: [G, H, R, D], contiguous
    q = tl.load(q_ptr + q_off, mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    top = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # running maximum of each row's scores (finite: see below)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)  # running sum of exp(score - top)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    k_base = kv_ptr + hk * stride_kv_head
    v_base = k_base + stride_kv_side
    for start in range(0, T, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t < T
        slot = tl.load(slots_ptr + g * T + t, mask=t_ok, other=0).to(tl.int64)  # [BLOCK_N] pool slots
        kv_off = slot[:, None] * stride_kv_slot + d[None, :]
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + kv_off, mask=kv_ok, other=0.0)  # [BLOCK_N, BLOCK_D], read where it lies
        v = tl.load(v_base + kv_off, mask=kv_ok, other=0.0)
        seen = tl.load(mask_ptr + (g * R + row)[:, None] * T + t[None, :], mask=m_ok[:, None] & t_ok[None, :],
                       other=0)  # [BLOCK_M, BLOCK_N]: row attends key t
        scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        scores = tl.where(seen != 0, scores, float("-inf"))
        # (a row that has seen no key yet keeps top at -1e30: its masked scores give exp(-inf) = 0, never NaN)
        new_top = tl.maximum(top, tl.max(scores, 1))
        p = tl.exp(scores - new_top[:, None])
        keep = tl.exp(top - new_top)
        total = total * keep + tl.sum(p, 1)
        acc = acc * keep[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        top = new_top
    out = acc / tl.where(total > 0, total, 1.0)[:, None]  # (a row that sees no key at all: zeros)
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def paged_decode_attention(query: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                           scale: float, block_n: int = 64) -> torch.Tensor:
    """Queries [G, H, R, D] over the pool's keys and values `kv` [2, Hkv, slots, D] (one layer's) at `slots`
    [G, T] (long: key t of request g), where `mask` [G, 1, R, T] (bool) lets row r see key t -> [G, H, R, D], in
    the queries' dtype. Scores and the softmax are fp32. A row that sees no key gives zeros."""
    g, h, r, d = query.shape
    hkv, t = kv.shape[1], slots.shape[-1]
    if h % hkv or kv.shape[-1] != d or kv.stride(-1) != 1 or slots.shape[0] != g or mask.shape != (g, 1, r, t):
        raise ValueError(f"paged decode attention: queries {tuple(query.shape)}, pool {tuple(kv.shape)}, slots "
                         f"{tuple(slots.shape)} and mask {tuple(mask.shape)} do not fit together")
    query, slots = query.contiguous(), slots.reshape(g, t).contiguous()
    mask = mask.reshape(g, r, t).contiguous().view(torch.uint8)
    out = torch.empty_like(query)
    block_m = max(16, triton.next_power_of_2(h // hkv * r))  # (tl.dot takes tiles of 16 and up)
    _paged_decode_kernel[(g, hkv)](
        query, kv, slots, mask, out, scale, t, kv.stride(0), kv.stride(1), kv.stride(2),
        H=h, HKV=hkv, R=r, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)))
    return out
