"""The common decoder, Llama's, over model/blocks.py; each other family subclasses it and says
only what differs (llama.cpp's src/models/*.cpp over build_norm/build_attn/build_ffn).

A family is one class: the GGUF `general.architecture` and HF model type it is registered under,
how its GGUF metadata becomes a ModelConfig, how its file stores tensors differently from HF,
and its graph. Weight matrices go through `Weights` (the weight format is not the family's
business); norms and biases are read as float32.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model import blocks, moe
from vinoserve.model.config import ExpertRouting, Gating, ModelConfig
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.gguf_file import GGUFMeta, GGUFTensor
from vinoserve.model.rope import RopeConfig, yarn_attention_factor
from vinoserve.model.weights import Weights

# name -> the tensor as the file holds it, rows in HF order; GGUF names (blk.N.attn_q.weight, ...).
WeightSource = Callable[[str], GGUFTensor]


class Decoder:
    """Pre-norm decoder layers (RMSNorm, attention with RoPE, a SiLU-gated FFN, or a mixture of
    such FFNs where the file has `expert_count`: moe.py), tied or untied LM head; Q/K/V biases
    where the file has them (Qwen2)."""

    gguf_architecture: ClassVar[str] = "llama"
    hf_model_type: ClassVar[str] = "llama"
    hf_class: ClassVar[str] = "LlamaForCausalLM"
    # A mixture of experts' routing where the file gives no key for it: llama.cpp's choice for
    # the architecture (the flags its src/models/*.cpp pass to build_moe_ffn).
    expert_gating: ClassVar[Gating] = Gating.SOFTMAX
    expert_weights_norm: ClassVar[bool] = False

    # ---- the file
    @classmethod
    def config_from_gguf(cls, meta: GGUFMeta) -> ModelConfig:
        """The keys llama.cpp's converter writes for every architecture."""
        hidden = int(_required(meta, "embedding_length"))
        heads = int(_required(meta, "attention.head_count"))
        head_size = int(meta.key("attention.key_length", hidden // heads))
        vocab = meta.key("vocab_size") or len(meta.reader.fields["tokenizer.ggml.tokens"].data)
        rope_freqs = meta.tensors.get("rope_freqs.weight")
        scaling = _rope_scaling(meta)
        rope = RopeConfig(
            theta=float(meta.key("rope.freq_base", 10000.0)),
            dim=int(meta.key("rope.dimension_count", head_size)),
            scaling=scaling,
            freq_factors=tuple(float(x) for x in np.asarray(rope_freqs.data, np.float32)) if rope_freqs else None,
            attention_factor=yarn_attention_factor(scaling) if scaling and scaling["rope_type"] == "yarn" else 1.0,
        )
        eos = [meta.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return ModelConfig(
            architecture=meta.architecture,
            num_layers=int(_required(meta, "block_count")),
            hidden_size=hidden,
            intermediate_size=int(_required(meta, "feed_forward_length")),
            num_heads=heads,
            num_kv_heads=int(meta.key("attention.head_count_kv", heads)),
            head_size=head_size,
            vocab_size=int(vocab),
            rms_norm_eps=float(meta.key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope=rope,
            max_context=int(meta.key("context_length", 2048)),
            tie_word_embeddings=not meta.has("output.weight"),
            attention_bias=meta.has("blk.0.attn_q.bias"),
            bos_token_id=meta.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
            experts=cls.expert_routing(meta),
        )

    @classmethod
    def expert_routing(cls, meta: GGUFMeta) -> ExpertRouting | None:
        """The router of a mixture of experts (`expert_count` > 0), from the keys llama.cpp reads,
        the family's choices where the file has none (0, for the gating function and the scale,
        is unset to llama.cpp's loader as well)."""
        count = int(meta.key("expert_count", 0) or 0)
        if not count:
            return None
        gating = int(meta.key("expert_gating_func", cls.expert_gating) or cls.expert_gating)
        if gating not in Gating.__members__.values():
            raise ModelLoadError(f"{meta.path}: expert_gating_func {gating} is not one vinoserve knows "
                                 "(1 softmax, 2 sigmoid, 3 softmax over the selected)")
        return ExpertRouting(count, int(_required(meta, "expert_used_count")), Gating(gating),
                             bool(meta.key("expert_weights_norm", cls.expert_weights_norm)),
                             float(meta.key("expert_weights_scale", 0.0) or 1.0))

    @classmethod
    def from_file(cls, t: GGUFTensor, cfg: ModelConfig) -> GGUFTensor:
        """A tensor as the file stores it -> rows in HF's order."""
        return t

    @classmethod
    def hf_config(cls, cfg: ModelConfig) -> dict:
        """config.json of a converted model."""
        return {"architectures": [cls.hf_class], **cfg.to_hf_dict()}

    # ---- the graph
    def __init__(self, cfg: ModelConfig, weight: WeightSource, weights: Weights) -> None:
        self.cfg, self.weight, self.weights = cfg, weight, weights
        self.inputs = blocks.Inputs.create()
        self.sinks: list[ov.Node] = []

    def build(self) -> ov.Model:
        """Stateful decoder graph: logits [B, L, V] f32 from input_ids/attention_mask/position_ids/beam_idx."""
        embed = self.weights.table(self.weight("token_embd.weight"), "model.embed_tokens.weight")
        x = self.embed(embed)
        for i in range(self.cfg.num_layers):
            x = self.layer(x, i)
        x = self.norm(x, "output_norm.weight")
        head = embed if self.cfg.tie_word_embeddings else self.weights.table(self.weight("output.weight"),
                                                                             "lm_head.weight")
        logits = ops.matmul(x, head, transpose_a=False, transpose_b=True, name="lm_head")
        logits.output(0).set_names({"logits"})
        return ov.Model([ops.result(logits, name="logits")], self.sinks, self.inputs.parameters, "vinoserve_llm")

    def embed(self, table: ov.Output) -> ov.Output:
        return ops.gather(table, self.inputs.input_ids, blocks.const(0)).output(0)

    def layer(self, x: ov.Output, i: int) -> ov.Output:
        x = ops.add(x, self.attention(self.norm(x, f"blk.{i}.attn_norm.weight"), i))
        return ops.add(x, self.ffn(self.norm(x, f"blk.{i}.ffn_norm.weight"), i)).output(0)

    def attention(self, h: ov.Output, i: int) -> ov.Output:
        cfg, p = self.cfg, f"blk.{i}."
        q, k, v = self.qkv(h, i)
        q, k = self.qk_norm(blocks.heads(q, cfg.num_heads, cfg.head_size),
                            blocks.heads(k, cfg.num_kv_heads, cfg.head_size), i)
        rope = self.inputs.rope(cfg.rope_of(i))
        out, sinks = blocks.attention(rope.apply(q, cfg.head_size), rope.apply(k, cfg.head_size),
                                      blocks.heads(v, cfg.num_kv_heads, cfg.head_size), i, self.inputs,
                                      cfg.num_kv_heads, cfg.attention_scale, cfg.window(i), self.attention_sinks(i))
        self.sinks += sinks
        return blocks.linear(out, self.matrix(p + "attn_output.weight"), self.output_bias(i))

    def attention_sinks(self, i: int) -> np.ndarray | None:
        """Each head's learned softmax sink logit [H] (gpt-oss); None: none."""
        return None

    def output_bias(self, i: int) -> np.ndarray | None:
        """The attention output projection's bias (gpt-oss); None: none."""
        return None

    def qkv(self, h: ov.Output, i: int) -> tuple[ov.Output, ov.Output, ov.Output]:
        """q, k, v [B, L, heads * S]."""
        p = f"blk.{i}."

        def bias(name: str) -> np.ndarray | None:
            return self.weight(p + name).dequantize() if self.cfg.attention_bias else None

        return tuple(blocks.linear(h, self.matrix(f"{p}attn_{x}.weight"), bias(f"attn_{x}.bias")) for x in "qkv")

    def qk_norm(self, q: ov.Output, k: ov.Output, i: int) -> tuple[ov.Output, ov.Output]:
        """q [B, H, L, S], k [B, Hkv, L, S] before RoPE: as they are."""
        return q, k

    def head_norms(self, q: ov.Output, k: ov.Output, i: int) -> tuple[ov.Output, ov.Output]:
        """An RMSNorm over each head of q and k (`qk_norm` of the families that have one)."""
        return self.norm(q, f"blk.{i}.attn_q_norm.weight"), self.norm(k, f"blk.{i}.attn_k_norm.weight")

    def ffn(self, h: ov.Output, i: int) -> ov.Output:
        if self.cfg.experts is not None:
            return self.expert_ffn(h, i)
        p = f"blk.{i}."
        return blocks.gated_ffn(h, self.matrix(p + "ffn_gate.weight"), self.matrix(p + "ffn_up.weight"),
                                self.matrix(p + "ffn_down.weight"), self.cfg.hidden_act)

    def expert_ffn(self, h: ov.Output, i: int) -> ov.Output:
        """The routed experts: router `ffn_gate_inp`, experts `ffn_{gate,up,down}_exps`."""
        p = f"blk.{i}."
        router = self.weight(p + "ffn_gate_inp.weight").dequantize()
        return moe.expert_ffn(h, router, self.cfg.experts, *(self.experts(f"{p}ffn_{x}_exps.weight")
                                                             for x in ("gate", "up", "down")), self.cfg.hidden_act)

    # ---- helpers for families
    def norm(self, x: ov.Output, name: str) -> ov.Output:
        return blocks.rms_norm(x, self.weight(name).dequantize(), self.cfg.rms_norm_eps)

    def matrix(self, name: str) -> ov.Output:
        return self.weights.matrix(self.weight(name), name.removesuffix(".weight"))

    def experts(self, name: str) -> moe.ExpertMatrices:
        return self.weights.experts(self.weight(name), name.removesuffix(".weight"))


def _required(meta: GGUFMeta, key: str):
    value = meta.key(key)
    if value is None:
        raise ModelLoadError(f"{meta.path}: metadata key {meta.architecture}.{key} is missing")
    return value


def _rope_scaling(meta: GGUFMeta) -> dict | None:
    kind = meta.key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = meta.key("rope.scaling.factor")
    scaling = {"rope_type": kind, "factor": float(factor) if factor is not None else 1.0}
    orig = meta.key("rope.scaling.original_context_length")
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    for beta in ("beta_fast", "beta_slow"):  # YaRN's, where the converter found them in the config
        if meta.key(f"rope.scaling.yarn_{beta}") is not None:
            scaling[beta] = float(meta.key(f"rope.scaling.yarn_{beta}"))
    return scaling
