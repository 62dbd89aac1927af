"""GGUFs with random weights at the sizes users serve, for speed and memory figures: Llama shapes
and mixtures of experts (OLMoE-1B-7B's, Qwen3-30B-A3B's, gpt-oss-20b's).

The 135M built-in model fits in cache and hides what bytes per weight cost; these do not. Names
`<arch>-<shape>-<type>-random` (e.g. `llama-1.5b-q4_0-random`, `qwen3moe-30b-a3b-q4_k_m-random`,
`gpt-oss-20b-mxfp4-random`) are accepted as `--model` by `vinoserve bench engine` and `vinoserve bench llamacpp`; the file is
written once into the cache's bench/ directory. Shapes follow public configs; the vocabulary and
tokenizer are SmolLM2's (from the built-in GGUF), so prompts are real text. Weights ~N(0, 0.02),
norms 1: the text is noise, the timing is real (a random router spreads tokens over the experts
about evenly, as trained ones roughly do). Tensors are written one at a time, experts one expert
at a time (a 30B file never sits in memory).

    python -m vinoserve.bench.random_models llama-8b-q4_0-random     # write it, print its path
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from vinoserve.model import default_model
from vinoserve.model.storage import cache_root

SHAPES = {  # hidden, layers, heads, kv heads, intermediate
    "0.5b": (896, 24, 14, 2, 4864),  # Qwen2.5-0.5B
    "1.5b": (1536, 28, 12, 2, 8960),  # Qwen2.5-1.5B
    "3b": (3072, 28, 24, 8, 8192),  # Llama-3.2-3B
    "8b": (4096, 32, 32, 8, 14336),  # Llama-3.1-8B
}


@dataclass(frozen=True)
class Shape:
    """A model's dimensions; with `experts`, `ffn` is each expert's, `used` of them a token, a
    router per layer. Q/K norms: none, per head (Qwen3) or over the whole projection (OLMoE)."""

    arch: str  # GGUF general.architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_size: int
    ffn: int
    rope_base: float = 500000.0
    experts: int = 0
    used: int = 0
    qk_norm: str = ""  # "", "head" or "full"


MOE_SHAPES = {
    "1b-7b": Shape("olmoe", 2048, 16, 16, 16, 128, 1024, 10000.0, 64, 8, "full"),  # OLMoE-1B-7B-0924
    "30b-a3b": Shape("qwen3moe", 2048, 48, 32, 4, 128, 768, 1e6, 128, 8, "head"),  # Qwen3-30B-A3B
    "20b": Shape("gpt-oss", 2880, 24, 64, 8, 64, 2880, 150000.0, 32, 4),  # gpt-oss-20b
}
# what gguf-py can quantize, and llama.cpp's commonest mix (our K-quant writer, kquants.py)
TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "f16", "q4_k_m")
# gpt-oss as OpenAI ships it: MXFP4 experts (the other matrices Q8_0 here: their size, not their timing,
# is what Q8_0 or the checkpoint's BF16 would change much)
GPT_OSS_TYPES = ("mxfp4",)
_GPT_OSS_WINDOW = 128
_GPT_OSS_YARN = (32.0, 4096)  # factor, trained context

# (tensor name, float32 values) -> (raw data, ggml type): how each matrix is stored
Encoder = Callable[[str, np.ndarray], tuple[np.ndarray, gguf.GGMLQuantizationType]]


def names() -> list[str]:
    return list(_catalogue())


def _catalogue() -> dict[str, tuple[str, str]]:
    """name -> (shape, type) of every random model."""
    arch = {s: "llama" for s in SHAPES} | {s: m.arch for s, m in MOE_SHAPES.items()}
    return {f"{arch[s]}-{s}-{t}-random": (s, t) for s in arch
            for t in (GPT_OSS_TYPES if arch[s] == "gpt-oss" else TYPES)}


def one_type(qtype: gguf.GGMLQuantizationType) -> Encoder:
    """Every matrix in `qtype` (gguf-py's quantizer)."""
    if qtype == gguf.GGMLQuantizationType.F16:
        return lambda name, x: (x.astype(np.float16), qtype)
    return lambda name, x: (gguf.quants.quantize(x, qtype), qtype)


def resolve(model: str) -> str:
    """`model` itself, or for a random model's name the path of its GGUF (written if missing)."""
    found = _catalogue().get(model)
    if found is None:
        return model
    path = cache_root() / "bench" / f"{model}.gguf"
    if not path.is_file():
        shape, qtype = found
        layers = MOE_SHAPES[shape].layers if shape in MOE_SHAPES else SHAPES[shape][1]
        encode = q4_k_m(layers) if qtype == "q4_k_m" else mxfp4_experts() if qtype == "mxfp4" else \
            one_type(gguf.GGMLQuantizationType[qtype.upper()])
        write(path, shape, encode)
    return str(path)


def q4_k_m(layers: int) -> Encoder:
    """llama-quantize's Q4_K_M choice (llama_tensor_get_type): Q4_K throughout, Q6_K for the LM
    head and for attn_v and ffn_down (the experts' too: it matches the name's start) in the first
    and last eighth of the layers and every third one between them (`use_more_bits`)."""
    from vinoserve.bench import kquants

    T = gguf.GGMLQuantizationType

    def more_bits(layer: int) -> bool:
        return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2

    def encode(name: str, x: np.ndarray) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
        qtype = T.Q4_K
        if name == "output.weight":
            qtype = T.Q6_K
        elif name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")) and \
                more_bits(int(name.split(".")[1])):
            qtype = T.Q6_K
        return kquants.quantize(x, qtype), qtype
    return encode


def mxfp4_experts() -> Encoder:
    """gpt-oss' GGUFs: the experts MXFP4, every other matrix Q8_0."""
    T = gguf.GGMLQuantizationType
    experts, rest = one_type(T.MXFP4), one_type(T.Q8_0)
    return lambda name, x: (experts if "_exps." in name else rest)(name, x)


def write(path: Path, shape: str | Shape, encode: Encoder, log=print, extra_tokens: tuple[str, ...] = ()) -> Path:
    """`extra_tokens`: control tokens appended to SmolLM2's vocabulary (a VLM's image tokens)."""
    dims = shape if isinstance(shape, Shape) else _shape(shape)
    tokenizer = gguf.GGUFReader(default_model.fetch(default_model.DEFAULT_MODEL, log=lambda m: None))
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(part), dims.arch, use_temp_file=True)  # tensors spill to disk, not memory
    _copy_tokenizer(tokenizer, w, extra_tokens)
    w.add_name(path.stem)
    _metadata(w, dims)
    vocab = len(tokenizer.fields["tokenizer.ggml.tokens"].contents()) + len(extra_tokens)
    rng = np.random.default_rng(0)

    def add(name: str, raw: np.ndarray, qtype: gguf.GGMLQuantizationType) -> None:
        w.add_tensor(name, raw, raw_dtype=None if qtype in (gguf.GGMLQuantizationType.F16,) else qtype)

    def mat(name: str, rows: int, cols: int, count: int = 0) -> None:
        """A matrix, or `count` of them as one [count, rows, cols] tensor (experts), encoded one at a time."""
        parts = [encode(name, rng.standard_normal((rows, cols), dtype=np.float32) * 0.02) for _ in range(count or 1)]
        add(name, np.stack([raw for raw, _ in parts]) if count else parts[0][0], parts[0][1])

    log(f"writing {path.name} ({dims.arch}: {dims.layers} layers, hidden {dims.hidden}) ...")
    mat("token_embd.weight", vocab, dims.hidden)
    w.add_tensor("output_norm.weight", np.ones(dims.hidden, np.float32))
    mat("output.weight", vocab, dims.hidden)
    for i in range(dims.layers):
        _layer(w, dims, f"blk.{i}.", mat, rng)
    return finish(w, part, path)


def finish(w: gguf.GGUFWriter, part: Path, path: Path) -> Path:
    """Writes what `w` holds to `part`, then renames it `path`: a file under its final name is whole."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    part.rename(path)
    return path


def _shape(shape: str) -> Shape:
    if shape in MOE_SHAPES:
        return MOE_SHAPES[shape]
    hidden, layers, heads, kv_heads, ffn = SHAPES[shape]
    return Shape("llama", hidden, layers, heads, kv_heads, hidden // heads, ffn)


def _metadata(w: gguf.GGUFWriter, dims: Shape) -> None:
    """The keys llama.cpp's converter writes for the shape's architecture."""
    w.add_context_length(8192)
    w.add_embedding_length(dims.hidden)
    w.add_block_count(dims.layers)
    w.add_feed_forward_length(dims.ffn)
    w.add_head_count(dims.heads)
    w.add_head_count_kv(dims.kv_heads)
    if dims.head_size != dims.hidden // dims.heads:
        w.add_key_length(dims.head_size)
        w.add_value_length(dims.head_size)
    w.add_rope_dimension_count(dims.head_size)
    w.add_rope_freq_base(dims.rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    if dims.experts:
        w.add_expert_count(dims.experts)
        w.add_expert_used_count(dims.used)
        w.add_expert_feed_forward_length(dims.ffn)
    if dims.arch == "qwen2vl":  # Qwen2.5-VL's M-RoPE sections (16, 24, 24 of head 128's 64), scaled
        w.add_rope_dimension_sections([dims.head_size // 8, 3 * dims.head_size // 16, 3 * dims.head_size // 16, 0])
    if dims.arch == "gpt-oss":
        w.add_sliding_window(_GPT_OSS_WINDOW)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(_GPT_OSS_YARN[0])
        w.add_rope_scaling_orig_ctx_len(_GPT_OSS_YARN[1])


def _layer(w: gguf.GGUFWriter, dims: Shape, p: str, mat: Callable, rng: np.random.Generator) -> None:
    q, kv = dims.heads * dims.head_size, dims.kv_heads * dims.head_size
    gpt_oss = dims.arch == "gpt-oss"  # its FFN norm is named for following attention
    w.add_tensor(p + "attn_norm.weight", np.ones(dims.hidden, np.float32))
    w.add_tensor(p + ("post_attention_norm" if gpt_oss else "ffn_norm") + ".weight", np.ones(dims.hidden, np.float32))
    for name, rows, cols in [("attn_q", q, dims.hidden), ("attn_k", kv, dims.hidden), ("attn_v", kv, dims.hidden),
                             ("attn_output", dims.hidden, q)]:
        mat(f"{p}{name}.weight", rows, cols)
    if gpt_oss:
        _gpt_oss_vectors(w, dims, p, rng)
    elif dims.arch == "qwen2vl":  # Qwen2's Q/K/V biases
        for name, size in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            w.add_tensor(f"{p}{name}.bias", rng.standard_normal(size, dtype=np.float32) * 0.02)
    if dims.qk_norm:
        sizes = (dims.head_size, dims.head_size) if dims.qk_norm == "head" else (q, kv)
        for name, size in zip(("attn_q_norm", "attn_k_norm"), sizes):
            w.add_tensor(f"{p}{name}.weight", np.ones(size, np.float32))
    if not dims.experts:
        for name, rows, cols in [("ffn_gate", dims.ffn, dims.hidden), ("ffn_up", dims.ffn, dims.hidden),
                                 ("ffn_down", dims.hidden, dims.ffn)]:
            mat(f"{p}{name}.weight", rows, cols)
        return
    # the router stays F32, as llama-quantize leaves it
    w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((dims.experts, dims.hidden), dtype=np.float32) * 0.02)
    for name, rows, cols in [("ffn_gate_exps", dims.ffn, dims.hidden), ("ffn_up_exps", dims.ffn, dims.hidden),
                             ("ffn_down_exps", dims.hidden, dims.ffn)]:
        mat(f"{p}{name}.weight", rows, cols, count=dims.experts)


def _gpt_oss_vectors(w: gguf.GGUFWriter, dims: Shape, p: str, rng: np.random.Generator) -> None:
    """Biases on attention, router and experts; a sink logit per head."""
    q, kv = dims.heads * dims.head_size, dims.kv_heads * dims.head_size
    biases = {"attn_q": q, "attn_k": kv, "attn_v": kv, "attn_output": dims.hidden, "ffn_gate_inp": dims.experts}
    for name, size in biases.items():
        w.add_tensor(f"{p}{name}.bias", rng.standard_normal(size, dtype=np.float32) * 0.02)
    for name, size in (("ffn_gate_exps", dims.ffn), ("ffn_up_exps", dims.ffn), ("ffn_down_exps", dims.hidden)):
        w.add_tensor(f"{p}{name}.bias", rng.standard_normal((dims.experts, size), dtype=np.float32) * 0.02)
    w.add_tensor(p + "attn_sinks.weight", rng.standard_normal(dims.heads, dtype=np.float32))


def _copy_tokenizer(src: gguf.GGUFReader, w: gguf.GGUFWriter, extra: tuple[str, ...] = ()) -> None:
    appended = {"tokenizer.ggml.tokens": list(extra),
                "tokenizer.ggml.token_type": [int(gguf.TokenType.CONTROL)] * len(extra)}
    for name, f in src.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind, value = f.types[0], f.contents()
        if kind == gguf.GGUFValueType.ARRAY:
            value = list(value) + appended.get(name, [])
            w.add_array(name, value)
        elif kind == gguf.GGUFValueType.STRING:
            w.add_string(name, value)
        elif kind in (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32):
            w.add_uint32(name, int(value))
        elif kind == gguf.GGUFValueType.BOOL:
            w.add_bool(name, bool(value))


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["--help"]:
        if arg not in names():
            raise SystemExit(f"random models: {', '.join(names())}")
        print(resolve(arg))
