"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head Q/K norms, its own
head size) with a mixture of experts in every layer, softmax-routed, the top k's weights
renormalised (llama.cpp's src/models/qwen3moe.cpp always does; its converter writes no key
for it). `feed_forward_length` is the dense FFN's, unused: the experts' shapes are their own."""
from __future__ import annotations

from vinoserve.model.architectures.decoder import Decoder


class Qwen3Moe(Decoder):
    gguf_architecture = "qwen3moe"
    hf_model_type = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"
    expert_weights_norm = True

    qk_norm = Decoder.head_norms
