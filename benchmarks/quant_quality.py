"""Perplexity of GGUF weights kept in their quantized blocks (`auto`) against the same file dequantized.

The model is SmolLM2-135M-Instruct: the built-in Q4_1 file as is, and variants written from its
dequantized values (f32): every matrix Q8_0 (gguf-py), and a Q4_K_M-like mix made with the tests'
K-quant encoder (vinoserve/bench/kquants.py) the way llama.cpp assigns types: Q4_K where rows are a
multiple of 256 values (ffn_down), Q6_K for half the layers' ffn_down and attn_v, and llama.cpp's
fallback Q5_0 where rows are not (SmolLM2's 576-wide rows). `f32` is the dequantized reference:
the file's values exactly, in f32 constants. Two lossy ways of keeping Q4_1 at 4 bits are measured
beside `auto` (which adds each block's min exactly): `int4` (requantized to symmetric i4 groups)
and a zero point rounded to an integer (openvino.genai's Q4_1/Q4_K mapping, written here as a Q4_1
file whose mins are rounded to whole steps: `auto` of it computes exactly that model).

The mixture-of-experts variants (`moe-q4_0`, `moe-q4_k_m-like`, issue 57) are SmolLM2 upcycled the
way sparse-upcycled models start: every layer's FFN copied into 8 experts, each copy's weights
scaled by its own 1 + 0.1 N(0, 1) noise so they differ, a random router (2 of 8, weights
renormalised, Mixtral's routing), the experts quantized one by one. No real MoE checkpoint is at
hand here; trained weights and real activations through the expert path are what matter for
comparing `auto` (experts kept in their blocks, the plugin's GatherMatmul) with `f32`.

Teacher-forced perplexity over real English text (vinoserve.bench.perplexity, as docs/eviction.md
and benchmarks/results/ measure it): windows of --window-len tokens, the last --forced fed one
decode step at a time.

    python benchmarks/quant_quality.py                          # every variant, default compute and f32
    python benchmarks/quant_quality.py --variants q4_1 --precisions default --windows 2
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import gguf
import numpy as np

from vinoserve.bench import kquants
from vinoserve.bench.perplexity import perplexity, text_windows
from vinoserve.bench.random_models import finish
from vinoserve.model import default_model
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.storage import cache_root

T = gguf.GGMLQuantizationType
PRECISIONS = {"default": CompileOptions(), "f32": CompileOptions(inference_precision="f32", kv_cache_precision="f32"),
              "default-dm-off": CompileOptions(decode_model=False)}  # the default without the decode model


def _q4_k_m_like(name: str, x: np.ndarray, layer: int) -> T:
    if x.shape[1] % 256:
        return T.Q8_0 if name == "token_embd.weight" else T.Q5_0  # llama.cpp's fallback for Q4_K rows
    six = name.endswith(("ffn_down.weight", "attn_v.weight")) and layer % 2 == 0
    return T.Q6_K if six else T.Q4_K


def _rounded_min(name: str, raw: np.ndarray, qtype: T) -> np.ndarray:
    """Q4_1 blocks whose min is a whole number of steps: what a u4 zero point round(-min / d) computes."""
    if qtype != T.Q4_1:
        return raw
    blocks = raw.reshape(raw.shape[0], -1, 20).copy()
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        zp = np.clip(np.where(d > 0, np.round(-m / d), 0), 0, 15)
    blocks[..., 2:4] = (-zp * d).astype(np.float16).view(np.uint8)
    return blocks.reshape(raw.shape)


def _copy_fields(src: gguf.GGUFReader, w: gguf.GGUFWriter) -> gguf.GGUFWriter:
    for name, f in src.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(name, f.contents())
        else:
            w.add_key_value(name, f.contents(), f.types[0])
    return w


def write_variant(src: gguf.GGUFReader, out: Path, variant: str) -> Path:
    if out.is_file():
        return out
    w = _copy_fields(src, gguf.GGUFWriter(str(out) + ".part", "llama", use_temp_file=True))
    for t in src.tensors:
        raw = np.asarray(t.data)
        if variant == "q4_1-rounded-zp":
            w.add_tensor(t.name, _rounded_min(t.name, raw, t.tensor_type), raw_dtype=t.tensor_type)
            continue
        x = gguf.quants.dequantize(raw, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        if x.ndim == 1:
            w.add_tensor(t.name, x.astype(np.float32))
            continue
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else 0
        qtype = T.Q8_0 if variant == "q8_0" else _q4_k_m_like(t.name, x, layer)
        blocks = (kquants.quantize(x, qtype) if qtype in kquants.ENCODERS
                  else gguf.quants.quantize(x, qtype))
        w.add_tensor(t.name, blocks, raw_dtype=qtype)
    return finish(w, Path(str(out) + ".part"), out)


EXPERTS, USED = 8, 2


def write_moe_variant(src: gguf.GGUFReader, out: Path, variant: str) -> Path:
    """SmolLM2 upcycled (see the module's docstring): `llama` with expert_count, its FFNs as experts."""
    if out.is_file():
        return out
    w = _copy_fields(src, gguf.GGUFWriter(str(out) + ".part", "llama", use_temp_file=True))
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(USED)
    w.add_bool("llama.expert_weights_norm", True)
    rng = np.random.default_rng(0)
    for t in src.tensors:
        x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else 0
        if x.ndim == 1:
            w.add_tensor(t.name, x.astype(np.float32))
            continue
        kind = t.name.rsplit(".", 2)[-2] if t.name.startswith("blk.") else ""
        copies = [x * (1 + 0.1 * rng.standard_normal(x.shape, dtype=np.float32))
                  for _ in range(EXPERTS)] if kind in ("ffn_gate", "ffn_up", "ffn_down") else [x]
        qtype = T.Q4_0 if variant == "moe-q4_0" else _q4_k_m_like(t.name, x, layer)
        blocks = [kquants.quantize(c, qtype) if qtype in kquants.ENCODERS else gguf.quants.quantize(c, qtype)
                  for c in copies]
        name = t.name.replace(f".{kind}.", f".{kind}_exps.") if len(copies) > 1 else t.name
        w.add_tensor(name, np.stack(blocks) if len(copies) > 1 else blocks[0], raw_dtype=qtype)
        if kind == "ffn_up":  # one router a layer, f32 as llama-quantize leaves it
            w.add_tensor(f"blk.{layer}.ffn_gate_inp.weight",
                         rng.standard_normal((EXPERTS, x.shape[1]), dtype=np.float32) * 0.05)
    return finish(w, Path(str(out) + ".part"), out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="q4_1,q8_0,q4_k_m-like,q4_1-rounded-zp")
    ap.add_argument("--formats", default="f32,auto", help="the first is the reference")
    ap.add_argument("--precisions", default="default,f32")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window-len", type=int, default=1024)
    ap.add_argument("--forced", type=int, default=256)
    args = ap.parse_args()

    base = default_model.fetch(default_model.DEFAULT_MODEL, log=lambda m: None)
    src = gguf.GGUFReader(base)
    windows, available = text_windows(args.windows, args.window_len)
    prefill = args.window_len - args.forced
    print(f"SmolLM2-135M-Instruct, {args.windows} windows x {args.window_len} tokens ({available} available), "
          f"{args.forced} teacher-forced decode steps\n")
    print("| file | compute | weights | perplexity | / first |")
    print("| --- | --- | --- | --- | --- |")
    for variant in args.variants.split(","):
        write = write_moe_variant if variant.startswith("moe-") else write_variant
        path = base if variant == "q4_1" else write(src, cache_root() / "bench" / f"smollm2-135m-{variant}.gguf",
                                                    variant)
        for precision in args.precisions.split(","):
            ref = None
            for fmt in args.formats.split(","):
                start = time.perf_counter()
                ppl = perplexity(windows, prefill, PRECISIONS[precision], model=str(path), weight_format=fmt).perplexity
                ref = ref or ppl
                print(f"| {variant} | {precision} | {fmt} | {ppl:.4f} | {ppl / ref:.4f} |"
                      f" <!-- {time.perf_counter() - start:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
