"""The architecture facts the GGUF graph builder needs, in one typed place.

A converted model directory stores them as an HF-style config.json, so models exported by
optimum-cli and models converted from GGUF are served the same way (model/spec.py reads what the
engine needs of both, with rope_from_hf and sliding_windows_from_hf below).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from vinoserve.model.rope import RopeConfig, longrope, yarn_attention_factor


class Gating(IntEnum):
    """How router logits become expert weights: llama.cpp's `expert_gating_func` values."""

    SOFTMAX = 1  # softmax over all experts, then the top k
    SIGMOID = 2  # each expert's own sigmoid, then the top k
    SOFTMAX_SELECTED = 3  # the top k logits, then a softmax over those (gpt-oss)


@dataclass(frozen=True)
class ExpertRouting:
    """A mixture-of-experts FFN's router: `used` of `count` experts per token, their weights
    from `gating`, divided by their sum where `normalize`, times `scale`."""

    count: int
    used: int
    gating: Gating = Gating.SOFTMAX
    normalize: bool = False
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.used <= self.count:
            raise ValueError(f"{self.used} experts used a token out of {self.count}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_context: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has biases on Q, K and V
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    hidden_act: str = "silu"  # HF's name of the gated FFN's activation
    # Sliding-window attention: each layer's window in tokens, query included (0: the whole
    # context); empty when no layer has one.
    sliding_windows: tuple[int, ...] = ()
    local_rope: RopeConfig | None = None  # RoPE of the windowed layers, where theirs differs (Gemma 3)
    attention_scale: float | None = None  # None: 1/sqrt(head_size)
    experts: ExpertRouting | None = None  # a mixture of experts in every layer's FFN; None: dense

    def __post_init__(self) -> None:
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not group over {self.num_kv_heads} KV heads")

    def window(self, layer: int) -> int:
        """Layer's attention window in tokens, 0 for the whole context."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def rope_of(self, layer: int) -> RopeConfig:
        return self.local_rope if self.local_rope is not None and self.window(layer) else self.rope

    def to_hf_dict(self) -> dict:
        """HF transformers' config.json keys, so HF tools (and our own loader) can read it back."""
        d = {
            "model_type": self.architecture,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": self.rope.scaling,
            "max_position_embeddings": self.max_context,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "hidden_act": self.hidden_act,
        }
        if self.rope.freq_factors is not None:
            # llama.cpp keeps Llama 3.1 scaling as per-frequency factors with no HF equivalent key.
            d["vinoserve_rope_freq_factors"] = list(self.rope.freq_factors)
        if self.rope.dim != self.head_size:
            d["partial_rotary_factor"] = self.rope.dim / self.head_size
        if self.rope.attention_factor != 1.0:
            d["vinoserve_rope_attention_factor"] = self.rope.attention_factor
        if self.rope.sections is not None:
            d["vinoserve_mrope_section"] = list(self.rope.sections)
        if self.sliding_windows:
            d["sliding_window"] = max(self.sliding_windows)
            d["layer_types"] = ["sliding_attention" if w else "full_attention" for w in self.sliding_windows]
        if self.local_rope is not None:
            d["rope_local_base_freq"] = self.local_rope.theta
        if self.attention_scale is not None:
            d["query_pre_attn_scalar"] = self.attention_scale ** -2
        if self.experts is not None:
            d |= {"num_experts": self.experts.count, "num_experts_per_tok": self.experts.used,
                  "norm_topk_prob": self.experts.normalize}
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        model_type = d.get("model_type", "")
        heads = d["num_attention_heads"]
        head_size = d.get("head_dim") or d["hidden_size"] // heads
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        max_context = int(d.get("max_position_embeddings", 2048))
        rope = rope_from_hf(d, head_size, max_context)
        windows = sliding_windows_from_hf(d, d["num_hidden_layers"], max_context)
        return cls(
            architecture=model_type,
            num_layers=d["num_hidden_layers"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads", heads),
            head_size=head_size,
            vocab_size=d["vocab_size"],
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_context=max_context,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=d.get("hidden_act") or d.get("hidden_activation") or "silu",
            sliding_windows=windows,
            local_rope=_local_rope(d, rope.dim) if windows else None,
            attention_scale=float(d["query_pre_attn_scalar"]) ** -0.5 if d.get("query_pre_attn_scalar") else None,
        )


def rope_from_hf(d: dict, head_size: int, max_context: int) -> RopeConfig:
    """The model's main RoPE from an HF config.json (ValueError for a scaling RopeConfig refuses)."""
    factors = d.get("vinoserve_rope_freq_factors")
    # transformers >= 5 folds theta and scaling into one `rope_parameters` dict (per layer
    # kind where they differ: Gemma 3's full-attention layers are the model's main RoPE).
    params = d.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    scaling = d.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    theta = float(d.get("rope_theta", params.get("rope_theta", 10000.0)))
    rope_dim = int(head_size * d.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)))
    if scaling and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        original = scaling.get("original_max_position_embeddings", d.get("original_max_position_embeddings"))
        return longrope(theta, rope_dim, scaling["short_factor"], scaling["long_factor"], int(original),
                        max_context, scaling.get("attention_factor"))
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    default_factor = yarn_attention_factor(scaling) if kind == "yarn" else 1.0
    sections = d.get("vinoserve_mrope_section")
    return RopeConfig(theta=theta, dim=rope_dim, scaling=scaling, freq_factors=tuple(factors) if factors else None,
                      attention_factor=float(d.get("vinoserve_rope_attention_factor", default_factor)),
                      sections=tuple(sections) if sections else None)


def sliding_windows_from_hf(d: dict, num_layers: int, max_context: int) -> tuple[int, ...]:
    """Per-layer windows from HF's `sliding_window` and `layer_types` (transformers >= 5 writes
    both; older configs: every layer, unless `use_sliding_window` says off). A window as long as
    the context is none."""
    window = d.get("sliding_window")
    if not window or window >= max_context or d.get("use_sliding_window") is False:
        return ()
    types = d.get("layer_types") or ["sliding_attention"] * num_layers
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def _local_rope(d: dict, rope_dim: int) -> RopeConfig | None:
    """Gemma 3's RoPE of the windowed layers: its own base, unscaled."""
    local = (d.get("rope_parameters") or {}).get("sliding_attention") or {}
    theta = local.get("rope_theta", d.get("rope_local_base_freq"))
    return RopeConfig(float(theta), rope_dim) if theta is not None else None
