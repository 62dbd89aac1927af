"""Rotary position embedding frequencies, shared by the graph builder and KV-cache rotation.

Both places must use the model's OWN inverse frequencies (theta and any scaling): keys rotated
with a different table land at the wrong phase.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

SUPPORTED_SCALING = ("linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE of a Llama-family model, rotate-half pairing over the first `dim` channels of a head."""

    theta: float
    dim: int
    scaling: dict | None = None  # HF `rope_scaling` dict: {"rope_type": "linear"|"llama3"|"yarn", ...}
    # Per-frequency divisors as llama.cpp stores them (`rope_freqs.weight`, Llama 3.1 GGUFs;
    # LongRoPE's short or long factors).
    freq_factors: tuple[float, ...] | None = field(default=None, repr=False)
    attention_factor: float = 1.0  # cos and sin are scaled by it (LongRoPE's mscale)
    # M-RoPE (Qwen2-VL): how many of the dim/2 frequencies, in order, turn with the position's
    # temporal, height and width stream (HF's mrope_section); None: one stream, plain RoPE.
    sections: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        kind = self.scaling_type
        if kind is not None and kind not in SUPPORTED_SCALING:
            raise ValueError(
                f"unsupported rope scaling {kind!r}; supported: {', '.join(SUPPORTED_SCALING)}"
            )
        if self.freq_factors is not None and len(self.freq_factors) != self.dim // 2:
            raise ValueError(f"rope freq_factors has {len(self.freq_factors)} entries, expected {self.dim // 2}")
        if self.sections is not None and (len(self.sections) != 3 or sum(self.sections) != self.dim // 2):
            raise ValueError(f"M-RoPE sections {list(self.sections)} must be three counts of the {self.dim // 2} "
                             "rotary frequencies (temporal, height, width)")

    @property
    def scaling_type(self) -> str | None:
        if not self.scaling:
            return None
        kind = self.scaling.get("rope_type", self.scaling.get("type"))
        return None if kind == "default" else kind

    def inverse_frequencies(self) -> np.ndarray:
        """inv_freq[j] for j < dim/2, float64, with scaling applied (as HF's ROPE_INIT_FUNCTIONS)."""
        inv = 1.0 / (self.theta ** (np.arange(0, self.dim, 2, dtype=np.float64) / self.dim))
        if self.freq_factors is not None:
            inv = inv / np.asarray(self.freq_factors, dtype=np.float64)
        kind = self.scaling_type
        if kind == "linear":
            inv = inv / float(self.scaling["factor"])
        elif kind == "llama3":
            inv = _llama3_scale(inv, self.scaling)
        elif kind == "yarn":
            inv = _yarn_scale(inv, self.dim, self.theta, self.scaling)
        return inv


    def stream_frequencies(self) -> np.ndarray:
        """[2, dim/2] float64: the inverse frequencies that turn with the height and the width stream
        (0 elsewhere). A token at temporal position p whose height and width positions are p + dh
        and p + dw turns frequency j by p * inv[j] + dh * rows[0, j] + dw * rows[1, j]."""
        inv = self.inverse_frequencies()
        rows = np.zeros((2, len(inv)))
        if self.sections is not None:
            t, h, _ = self.sections
            rows[0, t:t + h], rows[1, t + h:] = inv[t:t + h], inv[t + h:]
        return rows


def _llama3_scale(inv: np.ndarray, s: dict) -> np.ndarray:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled)


def _yarn_scale(inv: np.ndarray, dim: int, theta: float, s: dict) -> np.ndarray:
    """YaRN (HF's _compute_yarn_parameters, llama.cpp's ggml_rope_yarn_corr_dims and rope_yarn):
    frequencies above `beta_fast` rotations over the trained context kept, those below
    `beta_slow` divided by the factor, a linear ramp between. `truncate` (HF's default) rounds the
    ramp's ends outwards, as llama.cpp always does; gpt-oss' config turns it off."""
    factor, orig = float(s["factor"]), float(s["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(float(s.get("beta_fast") or 32)), correction_dim(float(s.get("beta_slow") or 1))
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / max(high - low, 0.001), 0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def yarn_attention_factor(s: dict) -> float:
    """YaRN's scale of cos and sin: the config's `attention_factor`, else 0.1 ln(factor) + 1 (mscale)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def longrope(theta: float, dim: int, short: list[float], long: list[float], original_context: int,
             max_context: int, attention_factor: float | None = None) -> RopeConfig:
    """Phi-3's LongRoPE as one fixed table: the long factors where the served context exceeds
    the trained one, the short ones otherwise, and the attention factor either way. llama.cpp
    and vLLM choose so (by the context they serve); HF transformers switches per sequence once
    it outgrows the trained context, recomputing its cache (see docs/models.md)."""
    if attention_factor is None:
        scale = max_context / original_context
        attention_factor = math.sqrt(1 + math.log(scale) / math.log(original_context)) if scale > 1 else 1.0
    factors = long if max_context > original_context else short
    return RopeConfig(theta, dim, freq_factors=tuple(float(f) for f in factors), attention_factor=attention_factor)
