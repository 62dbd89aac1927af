"""OLMoE (allenai's OLMoE-1B-7B): Llama's layers with an RMSNorm over the whole Q and K projections
(before they split into heads, unlike Qwen3's per-head norms) and a mixture of experts in every
layer, softmax-routed, top-k weights as they come (llama.cpp's src/models/olmoe.cpp). Its GGUFs
keep HF's Q/K row order."""
from __future__ import annotations

import openvino as ov

from vinoserve.model.architectures.decoder import Decoder


class Olmoe(Decoder):
    gguf_architecture = "olmoe"
    hf_model_type = "olmoe"
    hf_class = "OlmoeForCausalLM"

    def qkv(self, h: ov.Output, i: int) -> tuple[ov.Output, ov.Output, ov.Output]:
        q, k, v = super().qkv(h, i)
        return self.norm(q, f"blk.{i}.attn_q_norm.weight"), self.norm(k, f"blk.{i}.attn_k_norm.weight"), v
