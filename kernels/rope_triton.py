"""Triton kernel for RoPE key re-rotation (same math as kernels.rope.rerotate_keys_torch).

On CPU, Triton runs only under its interpreter (TRITON_INTERPRET=1, set before
triton is imported); the tests use that to check this kernel against torch.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rerotate_kernel(
    keys_ptr, out_ptr, delta_ptr, inv_freq_ptr, T,
    HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # one (layer, head) row of [T, D] keys (int64: offsets pass 2**31 at long T)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, BLOCK_H)
    t_ok = t < T
    h_ok = h < HALF
    ok = t_ok[:, None] & h_ok[None, :]

    delta = tl.load(delta_ptr + t, mask=t_ok, other=0).to(tl.float32)
    freq = tl.load(inv_freq_ptr + h, mask=h_ok, other=0.0)
    angle = delta[:, None] * freq[None, :]
    cos = tl.cos(angle)
    sin = tl.sin(angle)

    offs = row * T * (2 * HALF) + t[:, None] * (2 * HALF) + h[None, :]
    x1 = tl.load(keys_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(keys_ptr + offs + HALF, mask=ok, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs, (x1 * cos - x2 * sin).to(out_ty), mask=ok)
    tl.store(out_ptr + offs + HALF, (x2 * cos + x1 * sin).to(out_ty), mask=ok)


def rerotate_keys_triton(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor,
                         block_t: int = 64) -> torch.Tensor:
    """Rotate `keys` [..., T, D] by `delta` [T] positions; returns a new tensor."""
    T, D = keys.shape[-2], keys.shape[-1]
    src = keys.contiguous().view(-1, T, D)
    out = torch.empty_like(src)
    delta = delta.to(device=keys.device, dtype=torch.int64).contiguous()
    inv_freq = inv_freq.to(device=keys.device, dtype=torch.float32).contiguous()
    grid = (src.shape[0], triton.cdiv(T, block_t))
    _rerotate_kernel[grid](src, out, delta, inv_freq, T,
                           HALF=D // 2, BLOCK_T=block_t, BLOCK_H=triton.next_power_of_2(D // 2))
    return out.view(keys.shape)
