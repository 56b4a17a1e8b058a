"""Re-rotating cached RoPE keys to a new position.

Hugging Face checkpoints use the half-split (rotate_half) layout: dimension i pairs
with i + D/2. A key stored at position p is k_raw * R(p) * s, where s is the rope
type's `attention_scaling`. Moving it to p + delta needs only R(delta), because
rotations compose and every supported rope type (default, linear, llama3, yarn)
has a fixed per-frequency `inv_freq`; s is already inside the stored key, so it is
not applied again. Angles and products are computed in fp32 whatever the key
dtype, because repeated low-precision rotations drift.
"""

import torch


def rerotate_keys_torch(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate `keys` [..., T, D] by `delta` [T] positions; returns a new tensor. Differentiable where `keys`
    needs a gradient (the trainer's); otherwise one fp32 copy rotated in place (the engine's, placing a moved
    parent)."""
    half = keys.shape[-1] // 2
    cos, sin = _cos_sin(delta, inv_freq)
    x = keys.to(torch.float32)
    x1, x2 = x[..., :half], x[..., half:]
    if torch.is_grad_enabled() and x.requires_grad:
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(keys.dtype)
    return _rotate_in_place(x.clone() if x is keys else x, cos, sin).to(keys.dtype)


def rerotate_keys_(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate `keys` [..., T, D] by `delta` [T] positions in place (a copy the caller owns); returns `keys`. In fp32
    on CPU, with one temporary of half its size, bit-identical to `rerotate_keys`; elsewhere through it."""
    _check(keys, delta, inv_freq)
    if keys.is_cuda or keys.dtype != torch.float32 or (torch.is_grad_enabled() and keys.requires_grad):
        return keys.copy_(rerotate_keys(keys, delta, inv_freq))
    return _rotate_in_place(keys, *_cos_sin(delta, inv_freq))


def _rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """fp32 keys [..., T, D] rotated by angles whose cos and sin are [T, D/2], in place, with one temporary of half
    their size; returns `x`."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    first = x1.clone()  # (the second half needs it as it was)
    x1.mul_(cos).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    x2.mul_(cos).addcmul_(first, sin)  # x2 cos + x1 sin
    return x


def _cos_sin(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = delta.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]  # [T, D/2]
    return angles.cos(), angles.sin()


def _check(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> None:
    if keys.shape[-1] != 2 * inv_freq.numel():
        raise ValueError(f"head_dim {keys.shape[-1]} is not 2 * len(inv_freq) = {2 * inv_freq.numel()}")
    if delta.shape != (keys.shape[-2],):
        raise ValueError(f"delta must have shape ({keys.shape[-2]},), got {tuple(delta.shape)}")


def rerotate_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate `keys` [..., T, D] by `delta` [T] positions into a copy (stored KV is never mutated).

    Uses the Triton kernel on CUDA, torch elsewhere.
    """
    _check(keys, delta, inv_freq)
    if keys.is_cuda:
        from braid.kernels.rope_triton import rerotate_keys_triton

        return rerotate_keys_triton(keys, delta, inv_freq)
    return rerotate_keys_torch(keys, delta, inv_freq)
