"""Tiny random HF models of several architectures, exported to OpenVINO IR as users export theirs:
optimum-intel's `main_export` (what `optimum-cli export openvino --task text-generation-with-past`
runs), or the CLI itself for int4 weights (it quantizes after exporting)."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from gguf_fixtures import EOS_ID, MERGES, TOKENS

WINDOW = 16  # tokens, far below the test prompts
# What differs from a plain decoder, per model_type. Qwen2 and Mistral get sliding windows too (in
# all layers, and above max_window_layers) so the windows the transformation finds are checked on
# three families; Phi-3 rotates 3/4 of each head as Phi-4-mini does.
ARCHITECTURES = {
    "llama": {},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "qwen3": {},
    "gemma3_text": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                    "query_pre_attn_scalar": 16},
    "phi3": {"partial_rotary_factor": 0.75, "pad_token_id": 0},
    "mistral": {"sliding_window": WINDOW},
    # Mixtures of experts, as optimum-intel exports them (the tiled block the plugin gathers):
    # eight experts, top-k > 1; Qwen2-MoE's shared expert; gpt-oss' biases, attention sinks and
    # sliding window on every other layer. (optimum-intel 2.1 exports no OLMoE.)
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 48, "norm_topk_prob": True},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 48,
                  "shared_expert_intermediate_size": 40},
    "gpt_oss": {"num_local_experts": 8, "num_experts_per_tok": 3, "sliding_window": WINDOW,
                "layer_types": ["sliding_attention", "full_attention"]},
}
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss")


@dataclass(frozen=True)
class Export:
    hf_dir: Path
    ir_dir: Path


def hf_tokenizer() -> PreTrainedTokenizerFast:
    """The GGUF fixtures' byte-level BPE, as an HF fast tokenizer optimum converts."""
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(TOKENS)},
                               merges=[tuple(m.split()) for m in MERGES]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=TOKENS[EOS_ID])


def save_tiny_hf(arch: str, out: Path, seed: int = 0, layers: int = 2) -> Path:
    cfg = AutoConfig.for_model(arch, vocab_size=len(TOKENS), hidden_size=64, intermediate_size=96,
                               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=512, eos_token_id=EOS_ID, tie_word_embeddings=False,
                               **ARCHITECTURES[arch])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Larger than HF's init so attention is far from uniform: a window applied wrongly shows.
            # Gemma's norms scale by (1 + w), the others' by w.
            base = 1.0 if "norm" in name and not arch.startswith("gemma") else 0.0
            p.copy_((base + 0.2 * torch.randn_like(p)).half().float())
    model.save_pretrained(out)
    hf_tokenizer().save_pretrained(out)
    return out


def export_ir(hf_dir: Path, out: Path) -> Path:
    from optimum.exporters.openvino import main_export
    from optimum.exporters.openvino import model_configs

    # optimum-intel 2.1 refuses Gemma exports above transformers 5.0 as untested; the export is
    # checked token for token against transformers by the tests that use it.
    for cls in (model_configs.GemmaOpenVINOConfig, model_configs.Gemma3TextOpenVINOConfig):
        cls.MAX_TRANSFORMERS_VERSION = None
    main_export(str(hf_dir), output=out, task="text-generation-with-past", convert_tokenizer=True)
    return out


def export_ir_int4(hf_dir: Path, out: Path) -> Path:
    """As a user would: optimum-cli, int4 weights (groups of 16: the tiny rows are 64 wide)."""
    subprocess.run([sys.executable, "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model",
                    str(hf_dir), "--task", "text-generation-with-past", "--weight-format", "int4", "--group-size",
                    "16", "--ratio", "1.0", str(out)], check=True, capture_output=True)
    return out
