"""Qwen1.5-MoE and Qwen2-MoE: Qwen2's attention (Q/K/V biases) with a mixture of experts in every
layer, softmax-routed, top-k weights as they come (llama.cpp's src/models/qwen2moe.cpp), plus a
shared expert every token runs (`ffn_{gate,up,down}_shexp`), scaled by the sigmoid of its own
one-row gate (`ffn_gate_inp_shexp`)."""
from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model import blocks
from vinoserve.model.architectures.decoder import Decoder


class Qwen2Moe(Decoder):
    gguf_architecture = "qwen2moe"
    hf_model_type = "qwen2_moe"
    hf_class = "Qwen2MoeForCausalLM"

    def expert_ffn(self, h: ov.Output, i: int) -> ov.Output:
        p = f"blk.{i}."
        shared = blocks.gated_ffn(h, self.matrix(p + "ffn_gate_shexp.weight"), self.matrix(p + "ffn_up_shexp.weight"),
                                  self.matrix(p + "ffn_down_shexp.weight"), self.cfg.hidden_act)
        # the gate stays f32, as the router does: a [1, hidden] row, its logit per token
        gate_row = self.weight(p + "ffn_gate_inp_shexp.weight").dequantize().reshape(1, -1)
        gate = ops.sigmoid(blocks.linear(h, blocks.const(gate_row, np.float32)))
        return ops.add(super().expert_ffn(h, i), ops.multiply(shared, gate)).output(0)
