"""Build a stateful Llama-family OpenVINO graph from numpy weights.

The graph has the shape optimum-cli exports (input_ids / attention_mask / position_ids / beam_idx,
KV state in ReadValue/Assign pairs feeding ScaledDotProductAttention), because that is what
OpenVINO's paged-attention transformation recognises and rewrites into PagedAttention ops.
"""
from __future__ import annotations

from collections.abc import Callable
import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino import opset6
from openvino.op.util import Variable, VariableInfo

from vinoserve.model.config import ModelConfig
from vinoserve.model.gguf_loader import GGUFTensor
from vinoserve.model.weights import WeightFormat, Weights

# name -> the tensor as the file holds it; GGUF names (blk.N.attn_q.weight, ...).
WeightSource = Callable[[str], GGUFTensor]


def _const(value, dtype=np.int64) -> ov.Output:
    return ops.constant(np.asarray(value, dtype=dtype)).output(0)


def _rms_norm(x: ov.Output, weight: np.ndarray, eps: float) -> ov.Output:
    var = ops.reduce_mean(ops.multiply(x, x), _const([-1]), keep_dims=True)
    normed = ops.divide(x, ops.sqrt(ops.add(var, _const(eps, np.float32))))
    return ops.multiply(normed, _const(weight, np.float32)).output(0)


def _linear(x: ov.Output, w: ov.Output, bias: np.ndarray | None = None) -> ov.Output:
    y = ops.matmul(x, w, transpose_a=False, transpose_b=True)
    return (y if bias is None else ops.add(y, _const(bias, np.float32))).output(0)


# Slices end at INT32_MAX, the half is negated by a Multiply with -1 and concatenated on axis -1:
# the form torch exports take, which OpenVINO's RoPE fusion (RoPEFusionGPTNEOX) recognises. The
# fused op matters for accuracy, not only speed: on a bf16 CPU the plugin then marks the cos/sin
# subgraph f32 (MarkRopeInputsToKeepInMixedPrecision); unfused, position * inv_freq is computed
# in bf16, whose 8-bit mantissa cannot even hold the position above 256.
_END = np.iinfo(np.int32).max


def _rotate_half(x: ov.Output, rope_dim: int) -> ov.Output:
    half = rope_dim // 2
    x1 = ops.slice(x, _const([0]), _const([half]), _const([1]), _const([3]))
    x2 = ops.slice(x, _const([half]), _const([_END]), _const([1]), _const([3]))
    return ops.concat([ops.multiply(x2, _const(-1.0, np.float32)), x1], axis=-1).output(0)


def _apply_rope(x: ov.Output, cos: ov.Output, sin: ov.Output, rope_dim: int, head_size: int) -> ov.Output:
    """x [B, H, L, S]; rotates the first rope_dim channels, passes the rest through."""
    if rope_dim == head_size:
        return ops.add(ops.multiply(x, cos), ops.multiply(_rotate_half(x, rope_dim), sin)).output(0)
    rot = ops.slice(x, _const([0]), _const([rope_dim]), _const([1]), _const([3]))
    rest = ops.slice(x, _const([rope_dim]), _const([_END]), _const([1]), _const([3]))
    rotated = ops.add(ops.multiply(rot, cos), ops.multiply(_rotate_half(rot, rope_dim), sin))
    return ops.concat([rotated, rest], axis=-1).output(0)


def _heads(x: ov.Output, n: int, head_size: int) -> ov.Output:
    """[B, L, n*S] -> [B, n, L, S]"""
    x = ops.reshape(x, _const([0, 0, n, head_size]), special_zero=True)
    return ops.transpose(x, _const([0, 2, 1, 3])).output(0)


def _kv_state(name: str, x: ov.Output, beam_idx: ov.Output, cfg: ModelConfig) -> tuple[ov.Output, ov.Node]:
    """Past K or V from a ReadValue, reordered by beam_idx, concatenated with this step's x."""
    shape = ov.PartialShape([-1, cfg.num_kv_heads, -1, cfg.head_size])
    info = VariableInfo()
    info.variable_id, info.data_type, info.data_shape = name, ov.Type.f32, shape
    var = Variable(info)
    batch = ops.gather(ops.shape_of(x), _const([0]), _const(0))
    empty = ops.broadcast(
        _const(0.0, np.float32),
        ops.concat([batch, _const([cfg.num_kv_heads, 0, cfg.head_size])], axis=0),
    )
    past = ops.gather(opset6.read_value(empty, var), beam_idx, _const(0))
    present = ops.concat([past, x], axis=2)
    return present.output(0), opset6.assign(present, var)


def _repeat_kv(x: ov.Output, cfg: ModelConfig) -> ov.Output:
    """[B, Hkv, K, S] -> [B, H, K, S] for grouped-query attention."""
    group = cfg.num_heads // cfg.num_kv_heads
    if group == 1:
        return x
    shape = ops.shape_of(x)
    target = ops.concat([
        ops.gather(shape, _const([0, 1]), _const(0)), _const([group]),
        ops.gather(shape, _const([2, 3]), _const(0)),
    ], axis=0)
    expanded = ops.broadcast(ops.unsqueeze(x, _const(2)), target, broadcast_spec="BIDIRECTIONAL")
    return ops.reshape(expanded, _const([0, cfg.num_heads, -1, cfg.head_size]), special_zero=True).output(0)


def _causal_mask(attention_mask: ov.Output, q_len: ov.Output, kv_len: ov.Output) -> ov.Output:
    """Additive mask [B, 1, L, K]: query i (absolute kv_len - L + i) sees key j <= it, if not padded."""
    q_pos = ops.add(ops.range(_const(0), q_len, _const(1), "i64"), ops.subtract(kv_len, q_len))
    k_pos = ops.range(_const(0), kv_len, _const(1), "i64")
    causal = ops.less_equal(ops.unsqueeze(k_pos, _const(0)), ops.unsqueeze(q_pos, _const(1)))  # [L, K]
    padded = ops.unsqueeze(ops.not_equal(attention_mask, _const(0)), _const([1, 2]))  # [B, 1, 1, K]
    allowed = ops.logical_and(ops.unsqueeze(causal, _const([0, 1])), padded)
    return ops.select(allowed, _const(0.0, np.float32), _const(-np.inf, np.float32)).output(0)


def build_model(cfg: ModelConfig, weight: WeightSource, weight_format: WeightFormat = "f16") -> ov.Model:
    """Stateful decoder graph: logits [B, L, V] f32 from input_ids/attention_mask/position_ids/beam_idx."""
    wf = Weights.of(weight_format)
    input_ids = ops.parameter([-1, -1], ov.Type.i64, name="input_ids")
    attention_mask = ops.parameter([-1, -1], ov.Type.i64, name="attention_mask")
    position_ids = ops.parameter([-1, -1], ov.Type.i64, name="position_ids")
    beam_idx = ops.parameter([-1], ov.Type.i32, name="beam_idx")
    params = [input_ids, attention_mask, position_ids, beam_idx]
    for p in params:
        p.output(0).set_names({p.get_friendly_name()})

    embed = wf.table(weight("token_embd.weight"), "model.embed_tokens.weight")
    x = ops.gather(embed, input_ids, _const(0)).output(0)

    inv_freq = cfg.rope.inverse_frequencies().astype(np.float32)
    angles = ops.multiply(ops.unsqueeze(ops.convert(position_ids, ov.Type.f32), _const(2)),
                          _const(inv_freq.reshape(1, 1, -1), np.float32))
    emb = ops.concat([angles, angles], axis=2)
    cos = ops.unsqueeze(ops.cos(emb), _const(1)).output(0)  # [B, 1, L, rope_dim]
    sin = ops.unsqueeze(ops.sin(emb), _const(1)).output(0)

    q_len = ops.gather(ops.shape_of(input_ids), _const([1]), _const(0)).output(0)
    kv_len = ops.gather(ops.shape_of(attention_mask), _const([1]), _const(0)).output(0)
    mask = _causal_mask(attention_mask, ops.squeeze(q_len, _const(0)), ops.squeeze(kv_len, _const(0)))

    sinks = []
    for i in range(cfg.num_layers):
        x, layer_sinks = _decoder_layer(x, i, cfg, weight, wf, cos, sin, mask, beam_idx)
        sinks += layer_sinks

    x = _rms_norm(x, weight("output_norm.weight").dequantize(), cfg.rms_norm_eps)
    head = embed if cfg.tie_word_embeddings else wf.table(weight("output.weight"), "lm_head.weight")
    logits = ops.matmul(x, head, transpose_a=False, transpose_b=True, name="lm_head")
    logits.output(0).set_names({"logits"})
    result = ops.result(logits, name="logits")
    return ov.Model([result], sinks, params, "vinoserve_llm")


def _decoder_layer(x, i, cfg, weight, wf, cos, sin, mask, beam_idx):
    p = f"blk.{i}."

    def bias(name: str) -> np.ndarray | None:
        return weight(p + name).dequantize() if cfg.attention_bias else None

    h = _rms_norm(x, weight(p + "attn_norm.weight").dequantize(), cfg.rms_norm_eps)
    q = _heads(_linear(h, wf.matrix(weight(p + "attn_q.weight"), p + "attn_q"), bias("attn_q.bias")),
               cfg.num_heads, cfg.head_size)
    k = _heads(_linear(h, wf.matrix(weight(p + "attn_k.weight"), p + "attn_k"), bias("attn_k.bias")),
               cfg.num_kv_heads, cfg.head_size)
    v = _heads(_linear(h, wf.matrix(weight(p + "attn_v.weight"), p + "attn_v"), bias("attn_v.bias")),
               cfg.num_kv_heads, cfg.head_size)
    q = _apply_rope(q, cos, sin, cfg.rope.dim, cfg.head_size)
    k = _apply_rope(k, cos, sin, cfg.rope.dim, cfg.head_size)

    k_all, k_sink = _kv_state(f"past_key_values.{i}.keypresent.{i}.key", k, beam_idx, cfg)
    v_all, v_sink = _kv_state(f"past_key_values.{i}.valuepresent.{i}.value", v, beam_idx, cfg)
    attn = ops.scaled_dot_product_attention(q, _repeat_kv(k_all, cfg), _repeat_kv(v_all, cfg), mask,
                                            causal=False)
    attn = ops.reshape(ops.transpose(attn, _const([0, 2, 1, 3])),
                       _const([0, 0, cfg.num_heads * cfg.head_size]), special_zero=True)
    x = ops.add(x, _linear(attn, wf.matrix(weight(p + "attn_output.weight"), p + "attn_output"))).output(0)

    h = _rms_norm(x, weight(p + "ffn_norm.weight").dequantize(), cfg.rms_norm_eps)
    gate = _linear(h, wf.matrix(weight(p + "ffn_gate.weight"), p + "ffn_gate"))
    up = _linear(h, wf.matrix(weight(p + "ffn_up.weight"), p + "ffn_up"))
    down = _linear(ops.multiply(ops.swish(gate), up), wf.matrix(weight(p + "ffn_down.weight"), p + "ffn_down"))
    return ops.add(x, down).output(0), [k_sink, v_sink]
