"""Phi-3, Phi-3.5 and Phi-4-mini: Q, K and V in one fused `attn_qkv` matrix, gate and up in
one `ffn_up` (gate rows first), partial RoPE (Phi-4-mini: 96 of 128 channels), LongRoPE's
short/long factors with its attention factor, and a sliding window on every layer where the
model has one shorter than its context (Phi-3-mini-4k: 2047; llama.cpp ignores it, HF applies it)."""
from __future__ import annotations

from dataclasses import replace
import numpy as np
import openvino as ov

from vinoserve.model import blocks
from vinoserve.model.architectures.decoder import Decoder
from vinoserve.model.config import ModelConfig
from vinoserve.model.gguf_file import GGUFMeta
from vinoserve.model.rope import RopeConfig, longrope


class Phi3(Decoder):
    gguf_architecture = "phi3"
    hf_model_type = "phi3"
    hf_class = "Phi3ForCausalLM"

    @classmethod
    def config_from_gguf(cls, meta: GGUFMeta) -> ModelConfig:
        cfg = super().config_from_gguf(meta)
        rope = cfg.rope
        if meta.has("rope_factors_long.weight"):
            rope = longrope(rope.theta, rope.dim, meta.tensor("rope_factors_short.weight").dequantize().tolist(),
                            meta.tensor("rope_factors_long.weight").dequantize().tolist(),
                            int(meta.key("rope.scaling.original_context_length", cfg.max_context)), cfg.max_context,
                            meta.key("rope.scaling.attn_factor"))
        window = int(meta.key("attention.sliding_window", 0) or 0)
        windows = (window,) * cfg.num_layers if 0 < window < cfg.max_context else ()
        return replace(cfg, rope=rope, sliding_windows=windows)

    def qkv(self, h: ov.Output, i: int) -> tuple[ov.Output, ov.Output, ov.Output]:
        cfg, p = self.cfg, f"blk.{i}."
        fused = self.weight(p + "attn_qkv.weight")
        q, kv = cfg.num_heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size
        bounds = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
        return tuple(blocks.linear(h, self.weights.matrix(fused.rows(*bounds[x]), f"{p}attn_{x}")) for x in "qkv")

    def ffn(self, h: ov.Output, i: int) -> ov.Output:
        p, n = f"blk.{i}.", self.cfg.intermediate_size
        fused = self.weight(p + "ffn_up.weight")
        return blocks.gated_ffn(h, self.weights.matrix(fused.rows(0, n), p + "ffn_gate"),
                                self.weights.matrix(fused.rows(n, 2 * n), p + "ffn_up"),
                                self.matrix(p + "ffn_down.weight"), self.cfg.hidden_act)


def pin_longrope(model: ov.Model, rope: RopeConfig) -> int:
    """An optimum-cli export of a LongRoPE model picks its factors in the graph: Select(largest
    position + 1 > trained context, long, short). Under PagedAttention one step holds many
    sequences, so a sequence's RoPE would follow its neighbours' lengths (measured: a 40-token
    sequence's logits moved by 8 beside a 90-token one, trained context 64). In place: each such
    Select becomes the factors `rope` chose, as for a GGUF. Returns how many were."""
    want = np.asarray(rope.freq_factors, dtype=np.float64)
    pinned = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Select":
            continue
        for branch in (node.input_value(1), node.input_value(2)):
            table = branch.get_node()
            if (table.get_type_name() == "Constant" and table.get_output_partial_shape(0).to_shape() == [len(want)]
                    and np.allclose(table.get_data().astype(np.float64), want, rtol=1e-5)):
                node.output(0).replace(branch)
                pinned += 1
                break
    return pinned
