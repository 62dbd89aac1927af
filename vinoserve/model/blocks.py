"""The pieces every decoder graph is built from: norms, projections, RoPE, attention over KV
state, gated FFNs.

Graphs have the shape optimum-cli exports (input_ids / attention_mask / position_ids / beam_idx,
KV state in ReadValue/Assign pairs feeding ScaledDotProductAttention), because that is what
OpenVINO's paged-attention transformation recognises and rewrites into PagedAttention ops.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino import opset6
from openvino.op.util import Variable, VariableInfo
from openvino.utils.node_factory import NodeFactory

from vinoserve.model.rope import RopeConfig

_OPSET13 = NodeFactory("opset13")


def const(value, dtype=np.int64) -> ov.Output:
    return ops.constant(np.asarray(value, dtype=dtype)).output(0)


def rms_norm(x: ov.Output, weight: np.ndarray, eps: float) -> ov.Output:
    var = ops.reduce_mean(ops.multiply(x, x), const([-1]), keep_dims=True)
    normed = ops.divide(x, ops.sqrt(ops.add(var, const(eps, np.float32))))
    return ops.multiply(normed, const(weight, np.float32)).output(0)


def linear(x: ov.Output, w: ov.Output, bias: np.ndarray | None = None) -> ov.Output:
    y = ops.matmul(x, w, transpose_a=False, transpose_b=True)
    return (y if bias is None else ops.add(y, const(bias, np.float32))).output(0)


def heads(x: ov.Output, n: int, head_size: int) -> ov.Output:
    """[B, L, n*S] -> [B, n, L, S]"""
    x = ops.reshape(x, const([0, 0, n, head_size]), special_zero=True)
    return ops.transpose(x, const([0, 2, 1, 3])).output(0)


def merge_heads(x: ov.Output, n: int, head_size: int) -> ov.Output:
    """[B, n, L, S] -> [B, L, n*S]"""
    return ops.reshape(ops.transpose(x, const([0, 2, 1, 3])), const([0, 0, n * head_size]),
                       special_zero=True).output(0)


ACTIVATIONS = {
    "silu": lambda x: ops.swish(x),
    "gelu_pytorch_tanh": lambda x: ops.gelu(x, approximation_mode="tanh"),
}
# gpt-oss' experts (HF's GptOssExperts._apply_gate, llama.cpp's swiglu_oai): constants in both,
# no config or GGUF key sets them.
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


def _swiglu_oai(gate: ov.Output, up: ov.Output) -> ov.Output:
    """gate clamped above, up on both sides, gate * sigmoid(alpha gate) * (up + 1): a Swish with
    beta alpha, the form the CPU plugin's MoE patterns take for gpt-oss."""
    gate = ops.minimum(gate, const(SWIGLU_OAI_LIMIT, np.float32))
    up = ops.clamp(up, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    glu = ops.swish(gate, const(SWIGLU_OAI_ALPHA, np.float32))
    return ops.multiply(glu, ops.add(up, const(1.0, np.float32))).output(0)


def glu(activation: str, gate: ov.Output, up: ov.Output) -> ov.Output:
    """A gated FFN's hidden activation from its gate and up products: act(gate) * up for the
    names in ACTIVATIONS, or gpt-oss' clamped SwiGLU ("swiglu_oai")."""
    if activation == "swiglu_oai":
        return _swiglu_oai(gate, up)
    return ops.multiply(ACTIVATIONS[activation](gate), up).output(0)


def gated_ffn(x: ov.Output, gate: ov.Output, up: ov.Output, down: ov.Output, activation: str) -> ov.Output:
    """down(act(gate(x)) * up(x))"""
    return linear(glu(activation, linear(x, gate), linear(x, up)), down)


# Slices end at INT32_MAX, the half is negated by a Multiply with -1 and concatenated on axis -1:
# the form torch exports take, which OpenVINO's RoPE fusion (RoPEFusionGPTNEOX) recognises. The
# fused op matters for accuracy, not only speed: on a bf16 CPU the plugin then marks the cos/sin
# subgraph f32 (MarkRopeInputsToKeepInMixedPrecision); unfused, position * inv_freq is computed
# in bf16, whose 8-bit mantissa cannot even hold the position above 256.
_END = np.iinfo(np.int32).max
ROPE_OFFSETS = "rope_offsets"  # M-RoPE models' input (Inputs.rope_offsets)


def _rotate_half(x: ov.Output, rope_dim: int) -> ov.Output:
    half = rope_dim // 2
    x1 = ops.slice(x, const([0]), const([half]), const([1]), const([3]))
    x2 = ops.slice(x, const([half]), const([_END]), const([1]), const([3]))
    return ops.concat([ops.multiply(x2, const(-1.0, np.float32)), x1], axis=-1).output(0)


@dataclass(frozen=True)
class Rope:
    """cos/sin [B, 1, L, dim] of one RoPE table at the graph's positions."""

    cos: ov.Output
    sin: ov.Output
    dim: int

    def apply(self, x: ov.Output, head_size: int) -> ov.Output:
        """x [B, H, L, S]; rotates the first `dim` channels, passes the rest through."""
        if self.dim == head_size:
            return ops.add(ops.multiply(x, self.cos), ops.multiply(_rotate_half(x, self.dim), self.sin)).output(0)
        rot = ops.slice(x, const([0]), const([self.dim]), const([1]), const([3]))
        rest = ops.slice(x, const([self.dim]), const([_END]), const([1]), const([3]))
        rotated = ops.add(ops.multiply(rot, self.cos), ops.multiply(_rotate_half(rot, self.dim), self.sin))
        return ops.concat([rotated, rest], axis=-1).output(0)


@dataclass
class Inputs:
    """The graph's parameters, and what layers derive from them, built once per kind."""

    input_ids: ov.Node
    attention_mask: ov.Node
    position_ids: ov.Node
    beam_idx: ov.Node
    # M-RoPE models only (RopeConfig.sections): i64 [tokens, 2], each token's height and width
    # positions less its temporal one (position_ids): 0 on text, where the three streams agree.
    rope_offsets: ov.Node | None = None
    _masks: dict[int, ov.Output] = field(default_factory=dict)
    _ropes: dict[tuple, Rope] = field(default_factory=dict)

    @classmethod
    def create(cls) -> Inputs:
        made = cls(ops.parameter([-1, -1], ov.Type.i64, name="input_ids"),
                   ops.parameter([-1, -1], ov.Type.i64, name="attention_mask"),
                   ops.parameter([-1, -1], ov.Type.i64, name="position_ids"),
                   ops.parameter([-1], ov.Type.i32, name="beam_idx"))
        for p in made.parameters:
            p.output(0).set_names({p.get_friendly_name()})
        return made

    @property
    def parameters(self) -> list[ov.Node]:
        extra = [] if self.rope_offsets is None else [self.rope_offsets]
        return [self.input_ids, self.attention_mask, self.position_ids, self.beam_idx, *extra]

    def rope(self, cfg: RopeConfig) -> Rope:
        inv_freq = cfg.inverse_frequencies().astype(np.float32)
        key = (inv_freq.tobytes(), cfg.attention_factor)
        if key not in self._ropes:
            angles = ops.multiply(ops.unsqueeze(ops.convert(self.position_ids, ov.Type.f32), const(2)),
                                  const(inv_freq.reshape(1, 1, -1), np.float32))
            if cfg.sections is not None:
                angles = self._stream_angles(angles.output(0), cfg)
            emb = ops.concat([angles, angles], axis=2)
            cos, sin = ops.cos(emb), ops.sin(emb)
            if cfg.attention_factor != 1.0:
                factor = const(cfg.attention_factor, np.float32)
                cos, sin = ops.multiply(cos, factor), ops.multiply(sin, factor)
            self._ropes[key] = Rope(ops.unsqueeze(cos, const(1)).output(0), ops.unsqueeze(sin, const(1)).output(0),
                                    cfg.dim)
        return self._ropes[key]

    def _stream_angles(self, angles: ov.Output, cfg: RopeConfig) -> ov.Output:
        """M-RoPE: angles [B, L, dim/2] plus each token's height and width offsets times their
        streams' frequencies, elementwise (the plugin keeps every node above a fused RoPE's cos/sin
        in f32; a MatMul here might still run in bf16)."""
        if self.rope_offsets is None:
            self.rope_offsets = ops.parameter([-1, 2], ov.Type.i64, name=ROPE_OFFSETS)
            self.rope_offsets.output(0).set_names({ROPE_OFFSETS})
        offsets = ops.convert(self.rope_offsets, ov.Type.f32)
        rows = cfg.stream_frequencies().astype(np.float32)
        extra = ops.add(
            ops.multiply(ops.slice(offsets, const([0]), const([1]), const([1]), const([1])), const(rows[:1], np.float32)),
            ops.multiply(ops.slice(offsets, const([1]), const([2]), const([1]), const([1])), const(rows[1:], np.float32)))
        return ops.add(angles, ops.reshape(extra, ops.shape_of(angles), special_zero=False)).output(0)

    def mask(self, window: int) -> ov.Output:
        """Additive mask [B, 1, L, K]: query i (absolute kv_len - L + i) sees key j <= it, not
        padded, and with a window, fewer than `window` positions back (HF's convention)."""
        if window not in self._masks:
            q_len = ops.squeeze(ops.gather(ops.shape_of(self.input_ids), const([1]), const(0)), const(0))
            kv_len = ops.squeeze(ops.gather(ops.shape_of(self.attention_mask), const([1]), const(0)), const(0))
            q_pos = ops.unsqueeze(ops.add(ops.range(const(0), q_len, const(1), "i64"), ops.subtract(kv_len, q_len)),
                                  const(1))
            k_pos = ops.unsqueeze(ops.range(const(0), kv_len, const(1), "i64"), const(0))
            allowed = ops.less_equal(k_pos, q_pos)  # [L, K]
            if window:
                allowed = ops.logical_and(allowed, ops.less(ops.subtract(q_pos, k_pos), const(window)))
            padded = ops.unsqueeze(ops.not_equal(self.attention_mask, const(0)), const([1, 2]))  # [B, 1, 1, K]
            allowed = ops.logical_and(ops.unsqueeze(allowed, const([0, 1])), padded)
            self._masks[window] = ops.select(allowed, const(0.0, np.float32), const(-np.inf, np.float32)).output(0)
        return self._masks[window]


def _kv_state(name: str, x: ov.Output, beam_idx: ov.Output, num_kv_heads: int,
              head_size: int) -> tuple[ov.Output, ov.Node]:
    """Past K or V from a ReadValue, reordered by beam_idx, concatenated with this step's x."""
    info = VariableInfo()
    info.variable_id, info.data_type = name, ov.Type.f32
    info.data_shape = ov.PartialShape([-1, num_kv_heads, -1, head_size])
    var = Variable(info)
    batch = ops.gather(ops.shape_of(x), const([0]), const(0))
    empty = ops.broadcast(const(0.0, np.float32), ops.concat([batch, const([num_kv_heads, 0, head_size])], axis=0))
    past = ops.gather(opset6.read_value(empty, var), beam_idx, const(0))
    present = ops.concat([past, x], axis=2)
    return present.output(0), opset6.assign(present, var)


def _repeat_kv(x: ov.Output, num_heads: int, num_kv_heads: int, head_size: int) -> ov.Output:
    """[B, Hkv, K, S] -> [B, H, K, S] for grouped-query attention."""
    group = num_heads // num_kv_heads
    if group == 1:
        return x
    shape = ops.shape_of(x)
    target = ops.concat([
        ops.gather(shape, const([0, 1]), const(0)), const([group]),
        ops.gather(shape, const([2, 3]), const(0)),
    ], axis=0)
    expanded = ops.broadcast(ops.unsqueeze(x, const(2)), target, broadcast_spec="BIDIRECTIONAL")
    return ops.reshape(expanded, const([0, num_heads, -1, head_size]), special_zero=True).output(0)


def attention(q: ov.Output, k: ov.Output, v: ov.Output, layer: int, inputs: Inputs, num_kv_heads: int,
              scale: float | None = None, window: int = 0,
              sinks: np.ndarray | None = None) -> tuple[ov.Output, list[ov.Node]]:
    """Attention of q [B, H, L, S] over this layer's KV state extended by k, v [B, Hkv, L, S]:
    [B, L, H*S], and the state's Assign nodes. `scale` None is 1/sqrt(S). `sinks` [H]: a learned
    logit per head that joins each softmax's denominator and no value (gpt-oss). The
    transformation rewrites all of it into one PagedAttention op, which reads the scale and the
    sinks (its input 20) from here and takes the window from paged.to_paged (the mask's form is
    not one it recognises)."""
    num_heads, head_size = q.get_partial_shape()[1].get_length(), q.get_partial_shape()[3].get_length()
    k_all, k_sink = _kv_state(f"past_key_values.{layer}.keypresent.{layer}.key", k, inputs.beam_idx,
                              num_kv_heads, head_size)
    v_all, v_sink = _kv_state(f"past_key_values.{layer}.valuepresent.{layer}.value", v, inputs.beam_idx,
                              num_kv_heads, head_size)
    args = [q, _repeat_kv(k_all, num_heads, num_kv_heads, head_size),
            _repeat_kv(v_all, num_heads, num_kv_heads, head_size), inputs.mask(window)]
    if scale is not None or sinks is not None:
        args.append(const(head_size ** -0.5 if scale is None else scale, np.float32))
    if sinks is None:
        out = ops.scaled_dot_product_attention(*args, causal=False)
    else:  # opset13's Python wrapper takes no sinks; the op (and the transformation) does, as a 6th input
        args.append(const(np.asarray(sinks, np.float32).reshape(1, num_heads, 1, 1), np.float32))
        out = _OPSET13.create("ScaledDotProductAttention", args, {"causal": False})
    return merge_heads(out.output(0), num_heads, head_size), [k_sink, v_sink]
