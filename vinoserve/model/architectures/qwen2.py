"""Qwen2 / Qwen2.5: the common decoder with Q/K/V biases (read where the file has them); its
GGUFs keep HF's row order."""
from __future__ import annotations

from vinoserve.model.architectures.decoder import Decoder


class Qwen2(Decoder):
    gguf_architecture = "qwen2"
    hf_model_type = "qwen2"
    hf_class = "Qwen2ForCausalLM"
