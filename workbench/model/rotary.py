"""Rotary position embedding tables (neox style) for the rope types Llama-family configs use.

The table layout is the kernel contract's: ``cos_sin_cache[pos] = cat(cos(pos * inv_freq),
sin(pos * inv_freq))``, shape [max_positions, head_dim], float32.
"""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, rope_theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] (float32) for rope types default, linear, llama3.

    default: ``theta ** (-2i / head_dim)``. linear: the same divided by ``factor`` (positions
    interpolated). llama3: wavelengths shorter than ``original / high_freq_factor`` are kept, longer
    than ``original / low_freq_factor`` are divided by ``factor``, and those in between are blended
    linearly in ``original / wavelength``.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        original = float(rope_scaling["original_max_position_embeddings"])
        low, high = float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"])
        wavelength = 2 * math.pi / inv_freq
        # Blend weight: 1 keeps the frequency (short waves), 0 divides it by factor (long waves).
        keep = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
        keep = torch.where(wavelength < original / high, torch.ones_like(keep), keep)
        keep = torch.where(wavelength > original / low, torch.zeros_like(keep), keep)
        return keep * inv_freq + (1 - keep) * inv_freq / factor
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: default, linear, llama3.")


def build_cos_sin_cache(
    head_dim: int,
    max_positions: int,
    rope_theta: float,
    rope_scaling: dict | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of the angles in the first half, sin in the second."""
    inv_freq = inverse_frequencies(head_dim, rope_theta, rope_scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)
