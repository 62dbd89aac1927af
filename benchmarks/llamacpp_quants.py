"""Tiny random HF models of each family, written to GGUF and quantized by llama.cpp's own tools.

What a user's Q4_K_M file is, short of downloading one: a tiny random model saved by transformers
with a real vocabulary (one of llama.cpp's `models/ggml-vocab-*.gguf`, turned back into an HF
tokenizer by transformers), converted by llama.cpp's `convert_hf_to_gguf.py` (its own gguf-py on
PYTHONPATH) to f16, then quantized by `llama-quantize` to each type asked for. Prints which ggml
type each tensor got. Then `benchmarks/hf_agreement.py --model FILE.gguf --hf-config DIR` compares
each file in vinoserve and transformers.

    python benchmarks/llamacpp_quants.py --llamacpp /work/llamacpp-src \
        --quantize /work/llamacpp-src/build/bin/llama-quantize --out /tmp/kq [--family qwen3 ...]

`--ci-fixture FILE` instead writes tests/data's small K-quant file: a tiny Llama with the tests'
260-token vocabulary (tests/gguf_fixtures.py writes its f16 GGUF as the converter would; a real
vocabulary alone would be megabytes), quantized by llama-quantize as Q4_K_M with ffn_up as Q5_K
so that each K-quant type is in it.

Needs the test extras (torch, transformers). Hidden and intermediate sizes are multiples of 256
(the K-quants' super-block) except in `gemma3-1152`, shaped like Gemma 3 1B's hidden 1152
(4.5 x 256): llama-quantize falls back to another type for rows 256 does not divide.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig, LlamaConfig, Phi3Config,
                          Qwen2Config, Qwen3Config)

TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0", "Q8_0")

# name -> (config class, vocabulary file in llama.cpp's models/, chat template in models/templates, config)
FAMILIES: dict[str, tuple] = {
    "llama3": (LlamaConfig, "llama-bpe", "meta-llama-Llama-3.2-3B-Instruct.jinja", dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
    "qwen3": (Qwen3Config, "qwen2", "Qwen-Qwen3-0.6B.jinja", dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen2": (Qwen2Config, "qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja", dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=1e6)),
    "gemma3": (Gemma3TextConfig, "llama-bpe", "google-gemma-2-2b-it.jinja", dict(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
        head_dim=256, query_pre_attn_scalar=256, max_position_embeddings=4096, tie_word_embeddings=True,
        sliding_window=24, rope_theta=1e6, rope_local_base_freq=10000.0)),
    "gemma3-1152": (Gemma3TextConfig, "llama-bpe", "google-gemma-2-2b-it.jinja", dict(
        hidden_size=384, intermediate_size=768, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
        head_dim=256, query_pre_attn_scalar=256, max_position_embeddings=4096, tie_word_embeddings=True,
        sliding_window=24, rope_theta=1e6, rope_local_base_freq=10000.0)),
    # Phi-4-mini: GPT-2 style tokenizer, partial RoPE (3/4 of each head), LongRoPE past a trained context.
    "phi4-mini": (Phi3Config, "gpt-2", "microsoft-Phi-3.5-mini-instruct.jinja", dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, original_max_position_embeddings=64, partial_rotary_factor=0.75,
        tie_word_embeddings=True, rope_theta=10000.0, sliding_window=None, pad_token_id=0,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(24)],
                      "long_factor": [1.5 + 0.25 * i for i in range(24)]})),
}


def save_hf_model(name: str, llamacpp: Path, out: Path, seed: int = 0) -> Path:
    """The tiny model and its tokenizer in `out`, as `save_pretrained` writes them."""
    config_class, vocab, template, cfg = FAMILIES[name]
    tokenizer = AutoTokenizer.from_pretrained(llamacpp / "models", gguf_file=f"ggml-vocab-{vocab}.gguf")
    tokenizer.chat_template = (llamacpp / "models" / "templates" / template).read_text()
    config = config_class(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                          bos_token_id=tokenizer.bos_token_id, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    norm_centre = 0.0 if config.model_type == "gemma3_text" else 1.0  # Gemma scales by (1 + w)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            # Larger than HF's init so that attention is not uniform and tokens differ by position.
            p.copy_(norm_centre + 0.1 * torch.randn_like(p) if "norm" in param_name else 0.2 * torch.randn_like(p))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if vocab == "gpt-2":  # convert_hf_to_gguf's Phi3 reads the class to pick Phi-4's GPT-2 vocabulary
        _set_tokenizer_class(out, "GPT2Tokenizer")
    return out


def _set_tokenizer_class(out: Path, name: str) -> None:
    import json
    path = out / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["tokenizer_class"] = name
    path.write_text(json.dumps(data, indent=2))


def convert(hf_dir: Path, llamacpp: Path, f16: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(llamacpp / "gguf-py")}
    subprocess.run([sys.executable, str(llamacpp / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "f16",
                    "--outfile", str(f16)], check=True, env=env, capture_output=True)


def quantize(binary: Path, f16: Path, out: Path, qtype: str) -> None:
    subprocess.run([str(binary), str(f16), str(out), qtype], check=True, capture_output=True)


def type_mix(path: Path) -> str:
    """'Q4_K: 9, Q6_K: 3, ...' over the file's 2-D tensors, and which took which."""
    from gguf import GGUFReader
    mix: dict[str, list[str]] = collections.defaultdict(list)
    for t in GGUFReader(str(path)).tensors:
        if len(t.shape) == 2:
            mix[t.tensor_type.name].append(t.name)
    return "; ".join(f"{k} x{len(v)} ({', '.join(_short(v))})" for k, v in sorted(mix.items()))


def _short(names: list[str]) -> list[str]:
    """blk.N.attn_v.weight -> attn_v[N, ...] grouped by kind."""
    kinds: dict[str, list[str]] = collections.defaultdict(list)
    for n in names:
        parts = n.removesuffix(".weight").split(".")
        if parts[0] == "blk":
            kinds[parts[2]].append(parts[1])
        else:
            kinds[parts[0]] = []
    return [f"{k}[{','.join(v)}]" if v else k for k, v in kinds.items()]


def ci_fixture(binary: Path, target: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from gguf_fixtures import tiny_hf_model, write_gguf
    f16 = target.with_suffix(".f16.gguf")
    write_gguf(tiny_hf_model("llama", hidden=256, intermediate=512, heads=4, kv_heads=2, layers=2), f16)
    subprocess.run([str(binary), "--tensor-type", "ffn_up=q5_k", str(f16), str(target), "Q4_K_M"], check=True,
                   capture_output=True)
    f16.unlink()
    print(f"{target}: {target.stat().st_size / 1e6:.2f} MB; {type_mix(target)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llamacpp", type=Path, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    p.add_argument("--quantize", type=Path, required=True, help="the llama-quantize binary")
    p.add_argument("--out", type=Path)
    p.add_argument("--family", action="append", choices=FAMILIES, help="default: all")
    p.add_argument("--types", nargs="+", default=list(TYPES))
    p.add_argument("--ci-fixture", type=Path, help="write only the tests' small Q4_K_M file, here")
    args = p.parse_args()
    if args.ci_fixture:
        return ci_fixture(args.quantize, args.ci_fixture)
    for name in args.family or FAMILIES:
        hf_dir = save_hf_model(name, args.llamacpp, args.out / name / "hf")
        f16 = args.out / name / f"{name}-F16.gguf"
        convert(hf_dir, args.llamacpp, f16)
        for qtype in args.types:
            target = args.out / name / f"{name}-{qtype}.gguf"
            quantize(args.quantize, f16, target, qtype)
            print(f"{target.name}: {target.stat().st_size / 1e6:.1f} MB; {type_mix(target)}", flush=True)


if __name__ == "__main__":
    main()
