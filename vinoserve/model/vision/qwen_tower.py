"""Qwen2-VL / Qwen2.5-VL's vision tower and merger in OpenVINO ops, as transformers'
Qwen2VisionTransformerPretrainedModel / Qwen2_5_VisionTransformerPretrainedModel compute them
for one image size: the patch convolution as one matrix over HF's flattened patches, pre-norm
layers of non-causal attention with the 2D rotary on q and k, then the merger's norm and
Linear-GELU-Linear over each merge x merge block's states side by side. 2.5-VL's rows come
window by window (HF's order); its windowed layers attend within each window, the windows padded
to full squares and batched (a whole-image mask would cost full attention on every layer).
Same-size images batch: [B, patches, 3*2*P*P] -> [B, patches / merge^2, text width], in stages of
a few layers each (build_qwen_stages)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model.blocks import const, rms_norm
from vinoserve.model.vision.mmproj import MMProj
from vinoserve.model.vision.tower import activation, dense, layer_norm, weight

_MERGER_EPS = 1e-6  # HF's PatchMerger ln_q, a constant there; files keep no key for it
_RMS = "qwen2.5vl_merger"  # 2.5-VL's norms are RMSNorm (weights only), 2-VL's LayerNorm with bias


def _norm(x: ov.Output, mm: MMProj, name: str, eps: float) -> ov.Output:
    if mm.config.projector == _RMS:
        return rms_norm(x, mm.weight(f"{name}.weight").astype(np.float32), eps)
    return layer_norm(x, mm, name, eps)


def _patch_embedding(pixels: ov.Output, mm: MMProj) -> ov.Output:
    """HF's Conv3d (no bias) over a patch's (channel, frame, row, column) values: the file's two
    per-frame kernels side by side on the frame axis, as one matrix."""
    kernel = np.stack([mm.weight("v.patch_embd.weight"), mm.weight("v.patch_embd.weight.1")], axis=2)
    return ops.matmul(pixels, weight(kernel.reshape(kernel.shape[0], -1)), False, True).output(0)


def _rotate(x: ov.Output, cos: ov.Output, sin: ov.Output) -> ov.Output:
    """x * cos + rotate_half(x) * sin over the whole head; x [B, N, heads, head_dim]."""
    first, second = ops.split(x, const(-1), 2).outputs()
    half = ops.concat([ops.negative(second), first], axis=-1)
    return ops.add(ops.multiply(x, cos), ops.multiply(half, sin)).output(0)


@dataclass(frozen=True)
class _Windows:
    """2.5-VL's window inputs (qwen_inputs.Windows) as graph values."""
    gather: ov.Output  # [windows * slots] i64
    scatter: ov.Output  # [patches] i64
    mask: ov.Output  # [B * windows, 1, 1, slots] bool: the slots that hold a row
    slots: int  # rows a full window holds


def _in_windows(x: ov.Output, win: _Windows) -> ov.Output:
    """[B, N, heads, head_dim] in window order -> [B * windows, heads, slots, head_dim], padded."""
    padded = ops.gather(x, win.gather, const(1), batch_dims=0)
    y = ops.reshape(padded, const([-1, win.slots, 0, 0]), special_zero=True)
    return ops.transpose(y, const([0, 2, 1, 3])).output(0)


def _attend(q: ov.Output, k: ov.Output, v: ov.Output, batch: ov.Output, width: int, win: _Windows | None) -> ov.Output:
    """Non-causal attention of q, k, v [B, N, heads, head_dim] -> [B, N, width]: over the whole
    image, or (win) within each window, its pad slots masked out as keys and dropped after."""
    if win is None:
        q, k, v = (ops.transpose(t, const([0, 2, 1, 3])).output(0) for t in (q, k, v))
        out = ops.scaled_dot_product_attention(q, k, v, causal=False)
        return ops.reshape(ops.transpose(out, const([0, 2, 1, 3])), const([0, 0, width]), special_zero=True).output(0)
    out = ops.scaled_dot_product_attention(_in_windows(q, win), _in_windows(k, win), _in_windows(v, win), win.mask,
                                           causal=False)
    out = ops.reshape(ops.transpose(out, const([0, 2, 1, 3])), ops.concat([batch, const([-1, width])], axis=0),
                      special_zero=False)
    return ops.gather(out, win.scatter, const(1), batch_dims=0).output(0)


def _attention(x: ov.Output, mm: MMProj, prefix: str, rope: tuple[ov.Output, ov.Output], batch: ov.Output,
               win: _Windows | None) -> ov.Output:
    cfg = mm.config
    head = cfg.hidden_size // cfg.num_heads

    def heads(name: str) -> ov.Output:
        return ops.reshape(dense(x, mm, f"{prefix}.{name}"), const([0, 0, cfg.num_heads, head]),
                           special_zero=True).output(0)

    q, k = (_rotate(heads(name), *rope) for name in ("attn_q", "attn_k"))
    return dense(_attend(q, k, heads("attn_v"), batch, cfg.hidden_size, win), mm, f"{prefix}.attn_out")


def _mlp(x: ov.Output, mm: MMProj, prefix: str) -> ov.Output:
    """2.5-VL: down(silu(gate(x)) * up(x)); 2-VL: fc2(quick_gelu(fc1(x))), fc1 as ffn_up."""
    up = dense(x, mm, f"{prefix}.ffn_up")
    if mm.has(f"{prefix}.ffn_gate.weight"):
        up = ops.multiply(activation(dense(x, mm, f"{prefix}.ffn_gate"), mm.config.activation), up).output(0)
    else:
        up = activation(up, mm.config.activation)
    return dense(up, mm, f"{prefix}.ffn_down")


def _layer(x: ov.Output, mm: MMProj, i: int, rope: tuple[ov.Output, ov.Output], batch: ov.Output,
           win: _Windows | None) -> ov.Output:
    prefix, eps = f"v.blk.{i}", mm.config.layer_norm_eps
    x = ops.add(x, _attention(_norm(x, mm, f"{prefix}.ln1", eps), mm, prefix, rope, batch, win)).output(0)
    return ops.add(x, _mlp(_norm(x, mm, f"{prefix}.ln2", eps), mm, prefix)).output(0)


def _merger(x: ov.Output, mm: MMProj, merge: int) -> ov.Output:
    """The rows come merge block by merge block, so each block's states side by side are one row."""
    x = _norm(x, mm, "v.post_ln", _MERGER_EPS)
    x = ops.reshape(x, const([0, -1, mm.config.hidden_size * merge ** 2]), special_zero=True).output(0)
    x = ops.gelu(dense(x, mm, "mm.0"), approximation_mode="erf").output(0)
    return dense(x, mm, "mm.2")


def _parameter(name: str, shape: list[int], kind: ov.Type) -> ov.Node:
    node = ops.parameter(shape, kind, name=name)
    node.output(0).set_names({name})
    return node


def _windows(inputs: list[ov.Node], batch: ov.Output, slots: int) -> _Windows:
    gather, scatter = (_parameter(name, [-1], ov.Type.i64) for name in ("window_gather", "window_scatter"))
    valid = _parameter("window_valid", [-1, slots], ov.Type.boolean)
    inputs += [gather, scatter, valid]
    per_image = ops.reshape(valid, const([-1, 1, 1, slots]), special_zero=False)
    mask = ops.tile(per_image, ops.concat([batch, const([1, 1, 1])], axis=0))  # the images' windows one after another
    return _Windows(gather.output(0), scatter.output(0), mask.output(0), slots)


# Layers a compiled stage holds: a busy server rests between stages (server/vision_pacing.py), so
# a large image's tower (seconds on a few cores) does not hold the cores for all of its run.
STAGE_LAYERS = 8


def build_qwen_stages(mm: MMProj) -> list[ov.Model]:
    """The tower in stages of STAGE_LAYERS layers, run one after another: the first takes
    "pixel_values" [B, N, 3*2*P*P] f32, the others "states" [B, N, width]; every stage takes
    "rope_cos" / "rope_sin" [N, head_dim] f32 and, where one of its layers attends in windows,
    "window_gather" [windows * slots] i64, "window_scatter" [N] i64 and "window_valid" [windows,
    slots] bool (all from qwen_inputs.size_inputs, the patches then in its window order). Each
    gives "states", the last "embeddings" [B, N / merge^2, text width] after the merger."""
    cfg = mm.config
    if cfg.dynamic is None:
        raise ValueError(f"a {cfg.projector} projector has no Qwen-VL tower")
    starts = range(0, cfg.num_layers, STAGE_LAYERS)
    return [_stage(mm, start, min(start + STAGE_LAYERS, cfg.num_layers)) for start in starts]


def _stage(mm: MMProj, first: int, end: int) -> ov.Model:
    cfg, size = mm.config, mm.config.dynamic
    head = cfg.hidden_size // cfg.num_heads
    width = 3 * 2 * cfg.patch_size ** 2 if first == 0 else cfg.hidden_size
    states = _parameter("pixel_values" if first == 0 else "states", [-1, -1, width], ov.Type.f32)
    cos, sin = (_parameter(name, [-1, head], ov.Type.f32) for name in ("rope_cos", "rope_sin"))
    inputs = [states, cos, sin]
    rope = tuple(ops.unsqueeze(p, const([0, 2])).output(0) for p in (cos, sin))  # [1, N, 1, head_dim]
    batch = ops.gather(ops.shape_of(states), const([0]), const(0)).output(0)
    cells = size.window_size // size.merge // cfg.patch_size
    windowed = size.windowed and not all(size.full_attention(i) for i in range(first, end))
    win = _windows(inputs, batch, (cells * size.merge) ** 2) if windowed else None
    x = _patch_embedding(states.output(0), mm) if first == 0 else states.output(0)
    for i in range(first, end):
        x = _layer(x, mm, i, rope, batch, None if size.full_attention(i) else win)
    last = end == cfg.num_layers
    out = ops.result(_merger(x, mm, size.merge) if last else x)
    out.output(0).set_names({"embeddings" if last else "states"})
    return ov.Model([out], inputs, f"vision-{cfg.projector}-{first}")
