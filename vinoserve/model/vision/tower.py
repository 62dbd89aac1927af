"""The vision transformer of an mmproj file in OpenVINO ops, as clip.cpp builds it: patch
convolution, [CLS,] learned positions, optional pre-layernorm, pre-norm layers of non-causal
multi-head attention and a two-matrix MLP, optional post-layernorm. Batched over images of the
tower's one size: pixels [B, 3, S, S] -> states [B, tokens, width]."""
from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model.blocks import const, linear
from vinoserve.model.vision.mmproj import MMProj, VisionConfig


def weight(value: np.ndarray) -> ov.Output:
    """A weight as stored: float16 stays half in the model and is widened where it is used (the
    plugin's decompression pattern), everything else is float32."""
    if value.dtype == np.float16:
        return ops.convert(ops.constant(value), ov.Type.f32).output(0)
    return ops.constant(np.asarray(value, np.float32)).output(0)


def dense(x: ov.Output, mm: MMProj, name: str) -> ov.Output:
    """x @ W.T (+ b) for `name`.weight / `name`.bias (a bias only where the file has one)."""
    bias = mm.weight(f"{name}.bias").astype(np.float32) if mm.has(f"{name}.bias") else None
    return linear(x, weight(mm.weight(f"{name}.weight")), bias)


def layer_norm(x: ov.Output, mm: MMProj, name: str, eps: float) -> ov.Output:
    normed = ops.mvn(x, const([-1]), normalize_variance=True, eps=eps, eps_mode="inside_sqrt")
    out = ops.multiply(normed, weight(mm.weight(f"{name}.weight")))
    return ops.add(out, weight(mm.weight(f"{name}.bias"))).output(0)


def activation(x: ov.Output, kind: str) -> ov.Output:
    if kind == "quick_gelu":  # CLIP's: x * sigmoid(1.702 x)
        return ops.multiply(x, ops.sigmoid(ops.multiply(x, const(1.702, np.float32)))).output(0)
    if kind == "silu":
        return ops.swish(x).output(0)
    return ops.gelu(x, approximation_mode="tanh" if kind == "gelu_tanh" else "erf").output(0)


def _embeddings(pixels: ov.Output, mm: MMProj, cfg: VisionConfig) -> ov.Output:
    conv = ops.convolution(pixels, weight(mm.weight("v.patch_embd.weight")), strides=[cfg.patch_size] * 2,
                           pads_begin=[0, 0], pads_end=[0, 0], dilations=[1, 1])  # [B, H, P, P]
    if mm.has("v.patch_embd.bias"):
        conv = ops.add(conv, weight(mm.weight("v.patch_embd.bias").reshape(1, -1, 1, 1)))
    x = ops.transpose(ops.reshape(conv, const([0, cfg.hidden_size, -1]), special_zero=True), const([0, 2, 1]))
    if mm.has("v.class_embd"):  # CLIP: a learned first token, before the patches
        batch = ops.gather(ops.shape_of(pixels), const([0]), const(0))
        cls = ops.broadcast(weight(mm.weight("v.class_embd").reshape(1, 1, -1)),
                            ops.concat([batch, const([1, cfg.hidden_size])], axis=0))
        x = ops.concat([cls, x], axis=1)
    x = ops.add(x, ops.unsqueeze(weight(mm.weight("v.position_embd.weight")), const(0))).output(0)
    return layer_norm(x, mm, "v.pre_ln", cfg.layer_norm_eps) if mm.has("v.pre_ln.weight") else x


def _attention(x: ov.Output, mm: MMProj, cfg: VisionConfig, prefix: str) -> ov.Output:
    """Every token attends to every token of its own image: no mask, not causal."""
    head = cfg.hidden_size // cfg.num_heads

    def heads(name: str) -> ov.Output:
        y = ops.reshape(dense(x, mm, f"{prefix}.{name}"), const([0, 0, cfg.num_heads, head]), special_zero=True)
        return ops.transpose(y, const([0, 2, 1, 3])).output(0)

    out = ops.scaled_dot_product_attention(heads("attn_q"), heads("attn_k"), heads("attn_v"), causal=False)
    out = ops.reshape(ops.transpose(out, const([0, 2, 1, 3])), const([0, 0, cfg.hidden_size]), special_zero=True)
    return dense(out.output(0), mm, f"{prefix}.attn_out")


def _layer(x: ov.Output, mm: MMProj, cfg: VisionConfig, i: int) -> ov.Output:
    prefix, eps = f"v.blk.{i}", cfg.layer_norm_eps
    x = ops.add(x, _attention(layer_norm(x, mm, f"{prefix}.ln1", eps), mm, cfg, prefix)).output(0)
    hidden = activation(dense(layer_norm(x, mm, f"{prefix}.ln2", eps), mm, f"{prefix}.ffn_up"), cfg.activation)
    return ops.add(x, dense(hidden, mm, f"{prefix}.ffn_down")).output(0)


def build_tower(pixels: ov.Output, mm: MMProj) -> ov.Output:
    """[B, 3, S, S] pixels -> [B, tokens, width] states: the layers the file's projector reads,
    then its post-layernorm where it has one."""
    cfg = mm.config
    x = _embeddings(pixels, mm, cfg)
    for i in range(cfg.num_layers):
        x = _layer(x, mm, cfg, i)
    if mm.has("v.post_ln.weight"):
        x = layer_norm(x, mm, "v.post_ln", cfg.layer_norm_eps)
    return x
