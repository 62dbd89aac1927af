"""Qwen3: no biases, an RMSNorm over each head of Q and K before RoPE, and a head size of its
own (`qwen3.attention.key_length`, e.g. 128 at hidden 1024 with 16 heads)."""
from __future__ import annotations

from vinoserve.model.architectures.decoder import Decoder


class Qwen3(Decoder):
    gguf_architecture = "qwen3"
    hf_model_type = "qwen3"
    hf_class = "Qwen3ForCausalLM"

    qk_norm = Decoder.head_norms
