"""Write tiny random HF models as GGUF files the way llama.cpp's converter (convert_hf_to_gguf.py)
does: its tensor names (gguf-py's own name map), Q/K row permutation for llama, Gemma's norm
+1, Phi-3's fused tensors and LongRoPE factor tensors, mixtures of experts' merged `_exps`
tensors with F32 routers, and the metadata keys each writes."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, GptOssConfig, LlamaConfig, MistralConfig,
                          MixtralConfig, OlmoeConfig, Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                          Qwen3MoeConfig)

from vinoserve.bench import kquants as kquant_encoder

_CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
            "gemma3": Gemma3TextConfig, "phi3": Phi3Config, "qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig,
            "qwen2_moe": Qwen2MoeConfig, "olmoe": OlmoeConfig, "gpt_oss": GptOssConfig}
# Mistral's and Mixtral's GGUFs are llama; HF's MoE model types are spelled without the underscore
_GGUF_ARCH = {"mistral": "llama", "mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe",
              "gpt_oss": "gpt-oss"}
_PERMUTED = ("llama", "mistral", "mixtral")  # Q/K rows permuted for llama.cpp's GPT-J-style RoPE
_ROUTERS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # kept F32 by the converter and llama-quantize


def _bytes_to_unicode() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


BYTE_TOKENS = _bytes_to_unicode()
TOKENS = BYTE_TOKENS + ["Ġt", "he", "<|endoftext|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e"]
EOS_ID = len(TOKENS) - 1


@dataclass(frozen=True)
class Vocab:
    """A GGUF's tokenizer: byte-level BPE tokens (added ones as their plain text), their types, merges."""

    tokens: list[str]
    types: list[int]
    eos_id: int
    chat_template: str = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    merges: tuple[str, ...] = tuple(MERGES)
    pre: str = "gpt2"  # tokenizer.ggml.pre; llama.cpp itself loads "default", not "gpt2"


TINY_VOCAB = Vocab(TOKENS, [1] * (len(TOKENS) - 2) + [3, 3], EOS_ID)


def tiny_hf_model(arch: str = "llama", *, seed: int = 0, heads: int = 4, kv_heads: int = 2, layers: int = 2,
                  tie: bool = False, rope_scaling: dict | None = None, rope_theta: float = 10000.0,
                  head_dim: int | None = None, max_positions: int = 512, vocab: Vocab = TINY_VOCAB,
                  hidden: int = 64, intermediate: int = 96, **family):
    """`family`: that config class's own keys (sliding_window, partial_rotary_factor, ...). `hidden`
    and `intermediate` multiples of 256 for K-quant fixtures (their super-blocks)."""
    head_dim = head_dim or hidden // heads
    if arch != "phi3":  # Phi-3's head size is hidden / heads
        family["head_dim"] = head_dim
    if arch == "gemma3":  # as every Gemma 3 but the 27B (llama.cpp's rule: the file has no such key)
        family.setdefault("query_pre_attn_scalar", head_dim)
    cfg = _CONFIGS[arch](
        vocab_size=len(vocab.tokens), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        rms_norm_eps=1e-5, rope_theta=rope_theta, rope_scaling=rope_scaling, tie_word_embeddings=tie,
        eos_token_id=vocab.eos_id, bos_token_id=None, pad_token_id=None, attn_implementation="eager", **family,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # Gemma's norms scale by (1 + w), the others by w.
    norm_centre = 0.0 if arch == "gemma3" else 1.0
    with torch.no_grad():
        for p in model.parameters():
            # Larger than HF's init so attention is not uniform, rounded to f16 so the GGUF holds them exactly.
            p.copy_((torch.randn_like(p) * 0.2).half().float())
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((norm_centre + 0.1 * torch.randn_like(p)).half().float())
    return model


def quantize(a: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Raw blocks of `a` (rows along the last axis, any leading ones) in `qtype`: gguf-py's
    quantizer, or ours for the K-quants."""
    if qtype in kquant_encoder.ENCODERS:
        rows = a.reshape(-1, a.shape[-1])
        return kquant_encoder.quantize(rows, qtype, exact_scales=True).reshape(*a.shape[:-1], -1)
    return gguf.quants.quantize(a, qtype)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K row permutation (for its GPT-J style RoPE)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path, arch: str = "llama", q8_0: tuple[str, ...] = (), vocab: Vocab = TINY_VOCAB,
               quant: str | None = None, pooling: gguf.PoolingType | None = None,
               expert_quant: str | None = None, mrope_sections: tuple[int, int, int] | None = None) -> Path:
    """`q8_0`: GGUF tensor names to store as Q8_0 blocks. `quant`: a ggml type name (Q4_0, Q4_K,
    ...) for every matrix, token table included; `expert_quant` for the `_exps` matrices only
    (gpt-oss' MXFP4). The rest: matrices f16, vectors and biases f32. K-quants
    are written with scales whose products are exact f16s (kquant_encoder's `exact_scales`).
    `pooling`: the model is an embedder (LAST) or reranker (RANK), as `{arch}.pooling_type` says.
    `mrope_sections`: a Qwen2 model is Qwen2-VL's language model, written as its converter does
    (architecture qwen2vl, its M-RoPE sections and an unused fourth)."""
    cfg = model.config
    gguf_arch = "qwen2vl" if mrope_sections else _GGUF_ARCH.get(arch, arch)
    w = gguf.GGUFWriter(str(path), gguf_arch)
    if mrope_sections:
        w.add_rope_dimension_sections([*mrope_sections, 0])
    _common_metadata(w, cfg)
    _expert_metadata(w, cfg)
    if pooling is not None:
        w.add_pooling_type(pooling)
    _family_metadata(w, cfg, arch)
    _tokenizer(w, vocab)
    for out, a in _stored_tensors(model, arch, gguf_arch):
        matrix = a.ndim >= 2 and out.split(".", 2)[-1] not in _ROUTERS and not out.endswith(".bias")
        if expert_quant and matrix and "_exps." in out:
            qtype = gguf.GGMLQuantizationType[expert_quant]
            w.add_tensor(out, quantize(a, qtype), raw_dtype=qtype)
            continue
        if out in q8_0 or (quant and matrix):
            qtype = gguf.GGMLQuantizationType[quant if quant and out not in q8_0 else "Q8_0"]
            w.add_tensor(out, quantize(a, qtype), raw_dtype=qtype)
            continue
        # llama.cpp keeps 1-D tensors (norms, biases) and routers in f32, matrices in f16.
        w.add_tensor(out, a.astype(np.float16 if matrix else np.float32))
    if cfg.rope_parameters.get("rope_type") == "llama3":
        # LlamaModel.generate_extra_tensors: Llama 3 scaling as divisors of the plain inverse frequencies.
        exponents = np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim
        plain = 1.0 / cfg.rope_parameters["rope_theta"] ** exponents
        w.add_tensor("rope_freqs.weight", (plain / model.model.rotary_emb.inv_freq.double().numpy()).astype(np.float32))
    if arch == "phi3" and cfg.rope_parameters.get("long_factor"):
        w.add_tensor("rope_factors_long.weight", np.array(cfg.rope_parameters["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(cfg.rope_parameters["short_factor"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _stored_tensors(model, arch: str, gguf_arch: str):
    """(GGUF name, array as llama.cpp stores it) of each tensor. transformers keeps each layer's
    experts as one gate_up_proj [E, 2 * I, H] (gate rows first) and one down_proj [E, H, I];
    the converter writes them as ffn_{gate,up,down}_exps."""
    cfg = model.config
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == gguf_arch),
                                     cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.numpy()
        if arch == "gpt_oss" and (".mlp.experts." in name or name.endswith(".sinks")):
            yield from _gpt_oss_tensor(name, a, names)
            continue
        if ".mlp.experts." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            if name.endswith("gate_up_proj"):
                gate, up = np.split(a, 2, axis=1)
                yield f"blk.{layer}.ffn_gate_exps.weight", gate
                yield f"blk.{layer}.ffn_up_exps.weight", up
            else:
                yield f"blk.{layer}.ffn_down_exps.weight", a
            continue
        yield names.get_name(name, try_suffixes=(".weight", ".bias")), _as_stored(a, name, arch, cfg)


def _gpt_oss_tensor(name: str, a: np.ndarray, names):
    """GptOssModel's renaming: sinks get `.weight`; experts (HF [E, in, out], gate and up rows
    interleaved) become ffn_{gate,up,down}_exps [E, out, in] with their biases."""
    if name.endswith(".sinks"):
        yield names.get_name(name) + ".weight", a
        return
    layer = int(name.split(".layers.")[1].split(".")[0])
    kind = "bias" if name.endswith("_bias") else "weight"
    if "gate_up_proj" in name:
        a = a if kind == "bias" else a.swapaxes(1, 2)
        yield f"blk.{layer}.ffn_gate_exps.{kind}", np.ascontiguousarray(a[:, ::2])
        yield f"blk.{layer}.ffn_up_exps.{kind}", np.ascontiguousarray(a[:, 1::2])
    else:
        yield f"blk.{layer}.ffn_down_exps.{kind}", a if kind == "bias" else np.ascontiguousarray(a.swapaxes(1, 2))


def _as_stored(a: np.ndarray, name: str, arch: str, cfg) -> np.ndarray:
    if arch in _PERMUTED and "self_attn.q_proj" in name:
        return _permute(a, cfg.num_attention_heads)
    if arch in _PERMUTED and "self_attn.k_proj" in name:
        return _permute(a, cfg.num_key_value_heads)
    if arch == "gemma3" and name.endswith("norm.weight"):
        return a + 1.0  # Gemma3Model.norm_shift
    return a


def _common_metadata(w: gguf.GGUFWriter, cfg) -> None:
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)


def _expert_metadata(w: gguf.GGUFWriter, cfg) -> None:
    """TextModel's and Qwen2MoeModel's keys (no routing keys: llama.cpp fixes those per architecture)."""
    count = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if not count:
        return
    w.add_expert_count(count)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _family_metadata(w: gguf.GGUFWriter, cfg, arch: str) -> None:
    """What each converter class adds (LlamaModel, Qwen3Model, Gemma3Model, Phi3MiniModel)."""
    rope = cfg.rope_parameters
    if arch == "gemma3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_sliding_window(cfg.sliding_window)
        if rope["full_attention"].get("rope_type") == "linear":  # only the global layers' (4B and up)
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    elif arch == "phi3":
        rot_dims = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
        orig = rope.get("original_max_position_embeddings", cfg.max_position_embeddings)
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_dimension_count(rot_dims)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(cfg.sliding_window or 0)
        w.add_pad_token_id(cfg.eos_token_id)  # HF's Phi3Config would default to 32000, past a tiny vocabulary
        if rope.get("long_factor"):
            scale = cfg.max_position_embeddings / orig
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
    elif arch == "gpt_oss":  # TextModel's keys and GptOssModel's
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(cfg.sliding_window)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        if rope.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    else:
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_dimension_count(cfg.head_dim)
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
        if arch in ("qwen3", "qwen3_moe"):
            w.add_key_length(cfg.head_dim)
            w.add_value_length(cfg.head_dim)


def _tokenizer(w: gguf.GGUFWriter, vocab: Vocab) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(list(vocab.merges))
    w.add_eos_token_id(vocab.eos_id)
    w.add_add_bos_token(False)
    w.add_chat_template(vocab.chat_template)


# The families beyond Llama's, tiny, each with what sets it apart: windows shorter than the test
# prompts and not a multiple of the 32-token KV block, a head size other than hidden / heads,
# RoPE scaled on Gemma's global layers only, Phi-4-mini's partial RoPE, LongRoPE past a short
# trained context.
FAMILIES = {
    "qwen3": dict(arch="qwen3", heads=4, kv_heads=2, head_dim=32, rope_theta=1e6),
    "gemma3": dict(arch="gemma3", heads=2, kv_heads=1, head_dim=32, layers=6, tie=True, rope_theta=1e6,
                   sliding_window=24, rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "phi3": dict(arch="phi3", heads=4, kv_heads=2, partial_rotary_factor=0.75, sliding_window=40),
    "phi3-longrope": dict(arch="phi3", heads=4, kv_heads=2, original_max_position_embeddings=64,
                          rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                        "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
}


def family_gguf(spec: dict, path: Path):
    """(the HF model, its GGUF) for a FAMILIES entry (or any spec with an `arch`)."""
    kwargs = {k: v for k, v in spec.items() if k != "arch"}
    hf = tiny_hf_model(spec["arch"], **kwargs)
    return hf, write_gguf(hf, path, spec["arch"])
