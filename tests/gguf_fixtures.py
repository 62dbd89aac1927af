"""Write tiny random HF models as GGUF files the way llama.cpp's converter does."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

_CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}


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


TINY_VOCAB = Vocab(TOKENS, [1] * (len(TOKENS) - 2) + [3, 3], EOS_ID)


def tiny_hf_model(arch: str = "llama", *, seed: int = 0, heads: int = 4, kv_heads: int = 2, layers: int = 2,
                  tie: bool = False, rope_scaling: dict | None = None, rope_theta: float = 10000.0,
                  vocab: Vocab = TINY_VOCAB):
    cfg = _CONFIGS[arch](
        vocab_size=len(vocab.tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64 // heads,
        max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=rope_theta,
        rope_scaling=rope_scaling, tie_word_embeddings=tie, eos_token_id=vocab.eos_id,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            # Larger than HF's init so attention is not uniform, rounded to f16 so the GGUF holds them exactly.
            p.copy_((torch.randn_like(p) * 0.2).half().float())
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((1.0 + 0.1 * torch.randn_like(p)).half().float())
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K row permutation (for its GPT-J style RoPE)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path, arch: str = "llama", rope_freq_factors: np.ndarray | None = None,
               linear_scaling: float | None = None, q8_0: tuple[str, ...] = (), vocab: Vocab = TINY_VOCAB) -> Path:
    """`q8_0`: GGUF tensor names to store as Q8_0 blocks (the rest: matrices f16, vectors f32)."""
    cfg = model.config
    gguf_arch = "qwen2" if arch == "qwen2" else "llama"  # Mistral GGUFs use the llama architecture
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if linear_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear_scaling)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(list(vocab.merges))
    w.add_eos_token_id(vocab.eos_id)
    w.add_add_bos_token(False)
    w.add_chat_template(vocab.chat_template)

    permute = arch != "qwen2"
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }
    for name, t in model.state_dict().items():
        a = t.numpy()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out = "output.weight"
        else:
            _, _, layer, *rest = name.split(".")
            module, kind = ".".join(rest[:-1]), rest[-1]
            out = f"blk.{layer}.{names[module]}.{kind}"
            if permute and module == "self_attn.q_proj":
                a = _permute(a, cfg.num_attention_heads)
            elif permute and module == "self_attn.k_proj":
                a = _permute(a, cfg.num_key_value_heads)
        if out in q8_0:
            w.add_tensor(out, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        # llama.cpp keeps 1-D tensors (norms, biases) in f32, matrices in f16.
        w.add_tensor(out, a.astype(np.float16 if a.ndim == 2 else np.float32))
    if rope_freq_factors is not None:
        w.add_tensor("rope_freqs.weight", rope_freq_factors.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
