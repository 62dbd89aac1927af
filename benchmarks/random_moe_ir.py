"""An optimum-cli export of a random Qwen3-MoE with Qwen3-30B-A3B's layer shapes (and the random
GGUFs' vocabulary size), to time a mixture of experts from IR beside the GGUF of the same shapes:

    python benchmarks/random_moe_ir.py --layers 2 --out ~/.cache/vinoserve/bench/ir   # in the test-ir venv
    vinoserve bench llamacpp --model qwen3moe-30b-a3b-2of48-q4_0-random.gguf \\
        --ir-models ~/.cache/vinoserve/bench/ir/qwen3moe-30b-a3b-2of48-int4-sym-g32 --weight-formats auto

int4 weights, symmetric, groups of 32 (Q4_0's), as `optimum-cli export openvino --weight-format int4`
writes them (embeddings and LM head int8, its defaults). The prompt's token ids come from the GGUF's
tokenizer; this export carries a byte-level one only so that the directory loads.
"""
import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig

from vinoserve.bench.random_models import MOE_SHAPES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2, help="of the 48")
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache/vinoserve/bench/ir")
    args = ap.parse_args()
    s = MOE_SHAPES["30b-a3b"]
    cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=s.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_size,
                         moe_intermediate_size=s.ffn, num_experts=s.experts, num_experts_per_tok=s.used,
                         norm_topk_prob=True, rope_theta=s.rope_base, max_position_embeddings=4096,
                         tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out = args.out.expanduser() / f"qwen3moe-30b-a3b-{args.layers}of{s.layers}-int4-sym-g32"
    with tempfile.TemporaryDirectory() as hf:
        model.save_pretrained(hf)
        del model
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        byte_level = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
        byte_level.pre_tokenizer, byte_level.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
        PreTrainedTokenizerFast(tokenizer_object=byte_level, eos_token=alphabet[0]).save_pretrained(hf)
        subprocess.run([sys.executable, "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", hf,
                        "--task", "text-generation-with-past", "--weight-format", "int4", "--sym",
                        "--group-size", "32", "--ratio", "1.0", str(out)], check=True)
    print(out)


if __name__ == "__main__":
    main()
