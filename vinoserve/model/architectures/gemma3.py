"""Gemma 3 (text; llama.cpp's src/models/gemma3.cpp): embeddings scaled by sqrt(hidden), Q/K
head norms, a norm after attention and after the FFN as well as before each, a GELU(tanh)-gated
FFN, and sliding-window layers (5 in 6) with a RoPE of their own (base 10,000, unscaled; the
global layers take `rope.freq_base` and any scaling). GGUF norm weights already hold Gemma's +1.
Its residual stream reaches ~1e5, past f16's range: see docs/models.md for why that needs no
graph change on the CPU plugin."""
from __future__ import annotations

import math
from dataclasses import replace
import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model import blocks
from vinoserve.model.architectures.decoder import Decoder
from vinoserve.model.config import ModelConfig
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.gguf_file import GGUFMeta
from vinoserve.model.rope import RopeConfig

_PATTERN = 6  # every 6th layer global, llama.cpp's and HF's default for Gemma 3
_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62


class Gemma3(Decoder):
    gguf_architecture = "gemma3"
    hf_model_type = "gemma3_text"
    hf_class = "Gemma3ForCausalLM"

    @classmethod
    def config_from_gguf(cls, meta: GGUFMeta) -> ModelConfig:
        cfg = super().config_from_gguf(meta)
        if meta.key("final_logit_softcapping"):
            raise ModelLoadError(f"{meta.path}: gemma3 with final logit softcapping is not supported")
        window = int(meta.key("attention.sliding_window", 0) or 0)
        windows, local = (), None
        if window:
            pattern = meta.key("attention.sliding_window_pattern", _PATTERN)
            local_layers = ([bool(x) for x in pattern] if isinstance(pattern, list)
                            else [i % pattern < pattern - 1 for i in range(cfg.num_layers)])
            windows = tuple(window if is_local else 0 for is_local in local_layers)
            local = RopeConfig(float(meta.key("rope.freq_base_swa", _LOCAL_ROPE_BASE)), cfg.rope.dim)
        # The file has no query_pre_attn_scalar; llama.cpp's rule: the head size, except the
        # 27B's hidden / heads (168 where its head is 128).
        scalar = cfg.hidden_size / cfg.num_heads if cfg.num_layers == _GEMMA3_27B_LAYERS else cfg.head_size
        return replace(cfg, hidden_act="gelu_pytorch_tanh", sliding_windows=windows, local_rope=local,
                       attention_scale=1.0 / math.sqrt(scalar))

    def embed(self, table: ov.Output) -> ov.Output:
        scale = blocks.const(math.sqrt(self.cfg.hidden_size), np.float32)  # f32, as llama.cpp's and HF's at f32
        return ops.multiply(super().embed(table), scale).output(0)

    qk_norm = Decoder.head_norms

    def layer(self, x: ov.Output, i: int) -> ov.Output:
        p = f"blk.{i}."
        h = self.attention(self.norm(x, p + "attn_norm.weight"), i)
        x = ops.add(x, self.norm(h, p + "post_attention_norm.weight"))
        h = self.ffn(self.norm(x, p + "ffn_norm.weight"), i)
        return ops.add(x, self.norm(h, p + "post_ffw_norm.weight")).output(0)
