"""gpt-oss (OpenAI's gpt-oss-20b and -120b; llama.cpp's src/models/openai-moe-iswa.cpp, HF's
modeling_gpt_oss.py): biases on Q, K, V and the output projection, a learned sink logit per head
in every softmax, a 128-token sliding window on the even layers (HF's default layer_types;
llama.cpp's swa pattern 2), YaRN RoPE, and a mixture of experts in every layer behind a norm
the file calls `post_attention_norm`: a router with a bias, softmax over the top k's logits,
experts with biases on gate, up and down, and the clamped SwiGLU (blocks.glu "swiglu_oai").

YaRN as gpt-oss' config sets it: `truncate` false (the ramp's ends not rounded), as HF and
OpenAI's reference compute; llama.cpp's ggml_rope_yarn_corr_dims always rounds them, so its
frequencies differ slightly between the ramp's ends. The GGUF has no key for it. Both kinds
of layer share one RoPE, as in HF (llama.cpp reads a windowed layers' base from
`rope.freq_base_swa`, which its converter does not write for gpt-oss).
The experts usually come as MXFP4 (quantized.py keeps them as exact i8 groups)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model import moe
from vinoserve.model.architectures.decoder import Decoder
from vinoserve.model.config import Gating, ModelConfig
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.gguf_file import GGUFMeta

_SWA_PATTERN = 2  # llama.cpp's set_swa_pattern(2): layer i windowed when i % 2 == 0


class GptOss(Decoder):
    gguf_architecture = "gpt-oss"
    hf_model_type = "gpt_oss"
    hf_class = "GptOssForCausalLM"
    expert_gating = Gating.SOFTMAX_SELECTED

    @classmethod
    def config_from_gguf(cls, meta: GGUFMeta) -> ModelConfig:
        if meta.has("blk.0.ffn_gate_up_exps.weight"):
            raise ModelLoadError(f"{meta.path}: gpt-oss with fused ffn_gate_up_exps (convert_hf_to_gguf's "
                                 "--fuse-gate-up-exps) is not supported; convert without it")
        cfg = super().config_from_gguf(meta)
        if cfg.experts is None:
            raise ModelLoadError(f"{meta.path}: gpt-oss without {meta.architecture}.expert_count")
        window = int(meta.key("attention.sliding_window", 0) or 0)
        windows = tuple(window if i % _SWA_PATTERN < _SWA_PATTERN - 1 else 0
                        for i in range(cfg.num_layers)) if window else ()
        rope = cfg.rope
        if rope.scaling_type == "yarn":
            rope = replace(rope, scaling={**rope.scaling, "truncate": False})
        return replace(cfg, hidden_act="swiglu_oai", sliding_windows=windows, rope=rope,
                       intermediate_size=int(meta.key("expert_feed_forward_length", cfg.intermediate_size)))

    def layer(self, x: ov.Output, i: int) -> ov.Output:
        p = f"blk.{i}."
        x = ops.add(x, self.attention(self.norm(x, p + "attn_norm.weight"), i))
        return ops.add(x, self.ffn(self.norm(x, p + "post_attention_norm.weight"), i)).output(0)

    def attention_sinks(self, i: int) -> np.ndarray:
        return self.vector(f"blk.{i}.attn_sinks.weight")

    def output_bias(self, i: int) -> np.ndarray:
        return self.vector(f"blk.{i}.attn_output.bias")

    def expert_ffn(self, h: ov.Output, i: int) -> ov.Output:
        p = f"blk.{i}."
        gate, up, down = (replace(self.experts(f"{p}ffn_{x}_exps.weight"), bias=self.vector(f"{p}ffn_{x}_exps.bias"))
                          for x in ("gate", "up", "down"))
        return moe.expert_ffn(h, self.vector(p + "ffn_gate_inp.weight"), self.cfg.experts, gate, up, down,
                              self.cfg.hidden_act, router_bias=self.vector(p + "ffn_gate_inp.bias"))

    def vector(self, name: str) -> np.ndarray:
        """A small tensor (norm, bias, sink, router) as float32."""
        return self.weight(name).dequantize().astype(np.float32)
