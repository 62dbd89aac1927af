"""The OpenVINO graph of a BERT-family encoder over a ragged batch.

Every token-wise layer (embeddings, projections, FFN, norms) runs on the batch's tokens packed
end to end, [T, H] with no padding; only attention needs sequences side by side, so each layer
gathers its q/k/v into [B, L, ...] by `gather_index`, attends under an additive mask and scatters
the result back to the packed rows by `scatter_index`. The host decides the layout by what it
feeds: sequences padded to the longest (mask [B, 1, 1, L]), or all of them as one sequence under a
block-diagonal mask [1, 1, T, T]. Pooling is a [B, T] weight matrix times the packed states (CLS,
mean, last token are rows of it), so one graph serves every pooling mode.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model.blocks import const, linear
from vinoserve.model.encoders.config import EncoderConfig

INPUTS = {  # name -> (shape, type)
    "input_ids": ([-1], ov.Type.i64),
    "token_type_ids": ([-1], ov.Type.i64),
    "position_ids": ([-1], ov.Type.i64),
    "gather_index": ([-1, -1], ov.Type.i64),  # [B, L] -> packed row of each (sequence, position); pads any row
    "attention_mask": ([-1, 1, -1, -1], ov.Type.f32),  # [B, 1, 1 or L, L] additive: 0 or -inf
    "scatter_index": ([-1], ov.Type.i64),  # [T] -> its row in the flattened [B * L]
    "pool": ([-1, -1], ov.Type.f32),  # [B, T] pooling weights
}
Tensor = Callable[[str], np.ndarray]

_GELU = {"gelu": "erf", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def _layer_norm(x: ov.Output, weight: np.ndarray, bias: np.ndarray, eps: float) -> ov.Output:
    normed = ops.mvn(x, const([-1]), normalize_variance=True, eps=eps, eps_mode="inside_sqrt")
    return ops.add(ops.multiply(normed, const(weight, np.float32)), const(bias, np.float32)).output(0)


def _dense(x: ov.Output, tensor: Tensor, name: str, bias: bool = True) -> ov.Output:
    return linear(x, const(tensor(f"{name}.weight"), np.float32), tensor(f"{name}.bias") if bias else None)


def _activation(x: ov.Output, act: str) -> ov.Output:
    return (ops.relu(x) if act == "relu" else ops.gelu(x, approximation_mode=_GELU[act])).output(0)


def _attention(x: ov.Output, cfg: EncoderConfig, tensor: Tensor, prefix: str, inp: dict) -> ov.Output:
    """Self-attention of the packed rows x [T, H] within their own sequences: [T, H]."""
    if cfg.rope_base:  # nomic-bert: one fused matrix, rotary positions on the packed rows
        qkv = _rotate_qk(_dense(x, tensor, f"{prefix}.attention.self.qkv", cfg.linear_bias), cfg, inp)
    else:
        names = [f"{prefix}.attention.self.{p}" for p in ("query", "key", "value")]
        weight = np.concatenate([tensor(f"{n}.weight") for n in names])
        qkv = linear(x, const(weight, np.float32), np.concatenate([tensor(f"{n}.bias") for n in names]))
    qkv = ops.gather(qkv, inp["gather_index"], const(0))  # [B, L, 3H]
    qkv = ops.reshape(qkv, const([0, 0, 3, cfg.num_heads, cfg.head_size]), special_zero=True)
    qkv = ops.transpose(qkv, const([2, 0, 3, 1, 4]))  # [3, B, nH, L, S]
    q, k, v = (ops.squeeze(part, const([0])) for part in ops.split(qkv, const(0), 3).outputs())
    out = ops.scaled_dot_product_attention(q, k, v, inp["attention_mask"], causal=False)  # [B, nH, L, S]
    out = ops.reshape(ops.transpose(out, const([0, 2, 1, 3])), const([-1, cfg.hidden_size]), special_zero=False)
    out = ops.gather(out, inp["scatter_index"], const(0))  # back to [T, H]
    return _dense(out, tensor, f"{prefix}.attention.output.dense", cfg.linear_bias)


def _rotate_qk(qkv: ov.Output, cfg: EncoderConfig, inp: dict) -> ov.Output:
    """GPT-NeoX rotary positions (rotate the halves) on q and k of packed rows [T, 3H]."""
    half = cfg.head_size // 2
    inv_freq = (1.0 / cfg.rope_base ** (np.arange(half, dtype=np.float64) * 2 / cfg.head_size)).astype(np.float32)
    angles = ops.multiply(ops.unsqueeze(ops.convert(inp["position_ids"], ov.Type.f32), const(1)),
                          const(inv_freq[None, :], np.float32))  # [T, S/2]
    angles = ops.reshape(ops.concat([angles, angles], axis=1), const([-1, 1, 1, cfg.head_size]), special_zero=False)
    cos, sin = ops.cos(angles), ops.sin(angles)
    parts = ops.split(ops.reshape(qkv, const([-1, 3, cfg.num_heads, cfg.head_size]), special_zero=False), const(1), 3)
    rotated = []
    for x in parts.outputs()[:2]:
        x1, x2 = ops.split(x, const(3), 2).outputs()
        turned = ops.concat([ops.multiply(x2, const(-1.0, np.float32)), x1], axis=3)
        rotated.append(ops.add(ops.multiply(x, cos), ops.multiply(turned, sin)))
    both = ops.concat([*rotated, parts.output(2)], axis=1)
    return ops.reshape(both, const([-1, 3 * cfg.hidden_size]), special_zero=False).output(0)


def _layer(x: ov.Output, cfg: EncoderConfig, tensor: Tensor, prefix: str, inp: dict) -> ov.Output:
    eps = cfg.layer_norm_eps
    attn = ops.add(_attention(x, cfg, tensor, prefix, inp), x)
    x = _layer_norm(attn, tensor(f"{prefix}.attention.output.LayerNorm.weight"),
                    tensor(f"{prefix}.attention.output.LayerNorm.bias"), eps)
    up = _dense(x, tensor, f"{prefix}.intermediate.dense", cfg.linear_bias)
    if cfg.rope_base:  # nomic-bert's gated FFN
        hidden = ops.multiply(ops.swish(_dense(x, tensor, f"{prefix}.intermediate.gate", cfg.linear_bias)), up)
    else:
        hidden = _activation(up, cfg.hidden_act)
    out = ops.add(_dense(hidden, tensor, f"{prefix}.output.dense", cfg.linear_bias), x)
    return _layer_norm(out, tensor(f"{prefix}.output.LayerNorm.weight"), tensor(f"{prefix}.output.LayerNorm.bias"), eps)


def _embeddings(cfg: EncoderConfig, tensor: Tensor, inp: dict) -> ov.Output:
    def table(name: str, ids: ov.Node) -> ov.Output:
        return ops.gather(const(tensor(f"embeddings.{name}.weight"), np.float32), ids, const(0)).output(0)

    x = table("word_embeddings", inp["input_ids"])
    if not cfg.rope_base:
        x = ops.add(x, table("position_embeddings", inp["position_ids"]))
    if cfg.type_vocab_size > 1:
        x = ops.add(x, table("token_type_embeddings", inp["token_type_ids"]))
    elif cfg.type_vocab_size == 1:  # RoBERTa: one row, whatever types a tokenizer writes
        x = ops.add(x, const(tensor("embeddings.token_type_embeddings.weight")[0], np.float32))
    return _layer_norm(x, tensor("embeddings.LayerNorm.weight"), tensor("embeddings.LayerNorm.bias"),
                       cfg.layer_norm_eps)


def build_encoder(cfg: EncoderConfig, tensor: Tensor) -> ov.Model:
    """`tensor(name)` returns a weight by its Hugging Face name without the model's prefix
    (embeddings.word_embeddings.weight, encoder.layer.0..., pooler.dense.weight, classifier...).
    Output "pooled" [B, H] for an embedder, "logits" [B, num_labels] for a classifier."""
    inp = {name: ops.parameter(shape, dtype, name=name) for name, (shape, dtype) in INPUTS.items()}
    for p in inp.values():
        p.output(0).set_names({p.get_friendly_name()})
    x = _embeddings(cfg, tensor, inp)
    for i in range(cfg.num_layers):
        x = _layer(x, cfg, tensor, f"encoder.layer.{i}", inp)
    pooled = ops.matmul(inp["pool"], x, False, False).output(0)  # [B, H]
    if cfg.is_classifier:
        pooled = _classifier(pooled, cfg, tensor)
    result = ops.result(pooled)
    result.output(0).set_names({"logits" if cfg.is_classifier else "pooled"})
    return ov.Model([result], list(inp.values()), "encoder")


def _classifier(cls: ov.Output, cfg: EncoderConfig, tensor: Tensor) -> ov.Output:
    """BERT: tanh(pooler(CLS)) -> classifier. RoBERTa: tanh(classifier.dense(CLS)) -> out_proj."""
    if cfg.model_type == "bert":
        return _dense(ops.tanh(_dense(cls, tensor, "pooler.dense")), tensor, "classifier")
    return _dense(ops.tanh(_dense(cls, tensor, "classifier.dense")), tensor, "classifier.out_proj")
