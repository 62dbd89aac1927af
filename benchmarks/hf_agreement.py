"""One GGUF in vinoserve and in HF transformers at f32: greedy tokens, logits, tokenizer, chat template.

For a real model a user brings (a Qwen3 / Gemma 3 / Phi-4-mini / Llama 3.x Q4_K_M, ...):
transformers loads the SAME file (`from_pretrained(dir, gguf_file=...)`, dequantized to f32) as
the reference; vinoserve converts it with `--weight-format` (default `auto`: the file's blocks
kept low-bit) and computes at f32 with an f32 KV cache through PagedAttention.

    python benchmarks/hf_agreement.py --model Qwen3-0.6B-Q4_K_M.gguf --hf-config Qwen3-0.6B/ \
        [--prompts 6 --max-tokens 32 --weight-format auto]

`--hf-config DIR` (the model's own config.json, as on its HF page) gives transformers what its
GGUF reader does not read: Qwen3's head size, Llama 3's RoPE scaling, Gemma 3's attention scale
and local RoPE base, Phi-3's partial RoPE, LongRoPE and window. Without it transformers builds
the config from the GGUF alone, which for those families is another model.

Prompts are random token ids, one arriving per engine step with chunked prefill (the engine's
real batching), lengths spread up past the longest sliding window. Prints per prompt how many
greedy tokens equal HF's and the largest logit difference over the prompt; then token ids of
varied text and the chat template's rendering, each against transformers' tokenizer of the file.
Needs the test extras (torch, transformers). Exit status 1 when any token differs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from vinoserve.cache.kv_cache import KVCache
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk
from vinoserve.model.loader import load_model
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.weights import WEIGHT_FORMATS
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig

F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")
BLOCK = 32  # tokens per KV block (the engine's)
TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\n\n",
    "Numbers 1234567890 and 3.14159, dates 2024-01-31, prices $1,299.00",
    "  leading spaces,\ttabs,\r\nCRLF and trailing   ",
    "Ünïcödé: naïve café, 日本語のテキスト, русский текст, emoji 🙂🚀, ∑∫√",
    "<|im_start|>user\nspecial-looking tokens<|im_end|><|eot_id|><start_of_turn>",
]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]


def hf_reference(model: Path, hf_config: Path | None):
    config = None
    if hf_config is not None:
        config = AutoConfig.from_pretrained(hf_config)
        config.vocab_size = _gguf_vocab_size(model)  # converters may drop padding rows
    hf = AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name, config=config,
                                              dtype=torch.float32, attn_implementation="eager").eval()
    return hf, AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name)


def _gguf_vocab_size(model: Path) -> int:
    from gguf import GGUFReader
    for t in GGUFReader(str(model)).tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[1])
    raise SystemExit(f"{model}: no token_embd.weight")


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """HF's greedy tokens and its f32 logits over the prompt."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        prompt_logits, tokens = out.logits[0].numpy(), []
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, prompt_logits


def vinoserve_prompt_logits(loaded, prompts: list[list[int]]) -> list[np.ndarray]:
    """Each prompt alone, one prefill, logits at every position."""
    blocks = -(-max(map(len, prompts)) // BLOCK)
    runner = ModelRunner(loaded.paged, KVCache(loaded.paged.layout, loaded.config.num_layers, num_blocks=blocks))
    return [runner.step([ScheduledChunk(p, 0, [list(range(-(-len(p) // BLOCK)))], num_logits=len(p))]).logits[0].copy()
            for p in prompts]


def vinoserve_greedy(model: Path, weight_format: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """All prompts through the engine, one arriving per step, prefill in 48-token chunks."""
    blocks = sum(-(-(len(p) + n) // BLOCK) for p in prompts) + 1
    engine = LLMEngine(EngineConfig(model=str(model), weight_format=weight_format, compile=F32, num_kv_blocks=blocks,
                                    scheduler=SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=48)),
                       log=lambda m: None)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    step = 0
    while step < len(prompts) or engine.has_unfinished_requests:
        if step < len(prompts):
            engine.add_request(str(step), prompts[step], params)
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        step += 1
    return [out[str(i)] for i in range(len(prompts))]


def prompt_lengths(count: int, windows: tuple[int, ...]) -> list[int]:
    longest = max(130, max(windows, default=0) + 40)
    return [int(x) for x in np.linspace(5, longest, count)]


def compare_tokenizers(loaded, hf_tok) -> bool:
    ok = True
    for text in TEXTS:
        ours, theirs = loaded.tokenizer.encode(text), hf_tok(text).input_ids
        same = ours == theirs
        ok &= same
        print(f"  tokens {'equal' if same else 'DIFFER'} ({len(theirs)} ids): {text[:40]!r}"
              + ("" if same else f"\n    vinoserve {ours}\n    hf        {theirs}"))
    if loaded.tokenizer.chat_template:
        ours = _rendered(lambda: loaded.tokenizer.apply_chat_template(MESSAGES))
        theirs = _rendered(lambda: hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True))
        ok &= ours == theirs
        print(f"  chat template rendering {'equal' if ours == theirs else 'DIFFERS'} ({len(theirs)} chars)"
              + ("" if ours == theirs else f"\n    vinoserve {ours!r}\n    hf        {theirs!r}"))
    return ok


def _rendered(render) -> str:
    """The prompt, or that the template refused (Gemma's refuses a system turn): both count."""
    try:
        return render()
    except Exception as e:  # jinja2's error in HF, ours wraps it
        return f"refused: {str(e).removeprefix('chat template failed: ')}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a .gguf file")
    p.add_argument("--hf-config", type=Path, help="directory with the model's HF config.json")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--weight-format", default="auto", choices=WEIGHT_FORMATS)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    loaded = load_model(str(args.model), F32, args.weight_format, log=lambda m: None)
    hf, hf_tok = hf_reference(args.model, args.hf_config)
    vocab = min(hf.config.vocab_size, len(hf_tok))
    rng = np.random.default_rng(args.seed)
    windows = loaded.config.sliding_windows
    prompts = [rng.integers(0, vocab, n).tolist() for n in prompt_lengths(args.prompts, windows)]
    print(f"{args.model.name}: weights {args.weight_format}, f32 compute; windows {sorted(set(windows)) or 'none'}")

    ours = vinoserve_greedy(args.model, args.weight_format, prompts, args.max_tokens)
    our_logits = vinoserve_prompt_logits(loaded, prompts)
    equal, worst = 0, 0.0
    for i, (prompt, tokens, logits) in enumerate(zip(prompts, ours, our_logits)):
        ref, ref_logits = hf_greedy(hf, prompt, args.max_tokens)
        error = float(np.abs(logits - ref_logits).max())
        worst = max(worst, error)
        same = next((j for j, (a, b) in enumerate(zip(tokens, ref)) if a != b), len(ref))
        equal += same == len(ref)
        print(f"prompt {i} ({len(prompt)} tokens): {same}/{len(ref)} greedy tokens equal"
              f"{'' if same == len(ref) else f' (first differs at {same})'}; max logit error {error:.2e}"
              f" (logits up to {np.abs(ref_logits).max():.1f})")
    print(f"greedy: {equal}/{len(prompts)} prompts equal HF token for token; max logit error {worst:.2e}")
    print("tokenizer against transformers' reading of the file:")
    tok_ok = compare_tokenizers(loaded, hf_tok)
    print(json.dumps({"model": args.model.name, "prompts_equal": equal, "prompts": len(prompts),
                      "max_logit_error": worst, "tokenizer_equal": tok_ok}))
    return 0 if equal == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
