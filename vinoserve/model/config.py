"""The architecture facts the GGUF graph builder needs, in one typed place.

A converted model directory stores them as an HF-style config.json, so models exported by
optimum-cli and models converted from GGUF are served the same way (model/spec.py reads both).
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
