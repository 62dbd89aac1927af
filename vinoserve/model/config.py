"""The architecture facts the graph builder and the engine need, in one typed place.

A converted model directory stores them as an HF-style config.json, so models exported by
optimum-cli and models converted from GGUF are read the same way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from vinoserve.model.rope import RopeConfig

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


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

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not group over {self.num_kv_heads} KV heads")

    def to_hf_dict(self) -> dict:
        """HF transformers' config.json keys, so HF tools (and our own loader) can read it back."""
        model_type = self.architecture
        d = {
            "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM"}[model_type]],
            "model_type": model_type,
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
            "hidden_act": "silu",
        }
        if self.rope.freq_factors is not None:
            # llama.cpp keeps Llama 3.1 scaling as per-frequency factors with no HF equivalent key.
            d["vinoserve_rope_freq_factors"] = list(self.rope.freq_factors)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        model_type = d.get("model_type", "")
        heads = d["num_attention_heads"]
        head_size = d.get("head_dim") or d["hidden_size"] // heads
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        factors = d.get("vinoserve_rope_freq_factors")
        # transformers >= 5 folds theta and scaling into one `rope_parameters` dict.
        params = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
        rope = RopeConfig(
            theta=float(d.get("rope_theta", params.get("rope_theta", 10000.0))),
            dim=int(head_size * d.get("partial_rotary_factor", 1.0)),
            scaling=scaling,
            freq_factors=tuple(factors) if factors else None,
        )
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
            max_context=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        return cls.from_hf_dict(json.loads((path / "config.json").read_text()))
