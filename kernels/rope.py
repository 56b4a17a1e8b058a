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
    needs a gradient (the trainer's); otherwise written half by half into one output (the engine's, placing a
    moved parent: fp32 keys make no other tensor of their size)."""
    half = keys.shape[-1] // 2
    cos, sin = _cos_sin(delta, inv_freq)
    x = keys.to(torch.float32)
    x1, x2 = x[..., :half], x[..., half:]
    if torch.is_grad_enabled() and x.requires_grad:
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(keys.dtype)
    out = torch.empty_like(x)
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=out[..., half:]).addcmul_(x1, sin)  # x2 cos + x1 sin
    return out.to(keys.dtype)


def rerotate_keys_(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate `keys` [..., T, D] by `delta` [T] positions in place (a copy the caller owns); returns `keys`. In fp32
    on CPU, with one temporary of half its size, bit-identical to `rerotate_keys`; elsewhere through it."""
    _check(keys, delta, inv_freq)
    if keys.is_cuda or keys.dtype != torch.float32 or (torch.is_grad_enabled() and keys.requires_grad):
        return keys.copy_(rerotate_keys(keys, delta, inv_freq))
    half = keys.shape[-1] // 2
    cos, sin = _cos_sin(delta, inv_freq)
    x1, x2 = keys[..., :half], keys[..., half:]
    first = x1.clone()  # (the second half needs it as it was)
    x1.mul_(cos).addcmul_(x2, sin, value=-1)
    x2.mul_(cos).addcmul_(first, sin)
    return keys


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
