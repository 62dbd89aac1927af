"""Where speculation keeps greedy output token for token: the same prompts, greedy, with and without
prompt-lookup speculation, one request at a time (so the plain run decodes one token per step), at
each compute / KV-cache precision asked for. Prints how many outputs are identical and where the
others first differ.

    python benchmarks/speculative_precision.py --precisions bf16/,f32/,f32/f32
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from vinoserve.bench.workloads import stdlib_english
from vinoserve.engine.llm import LLM
from vinoserve.engine.llm_engine import EngineConfig
from vinoserve.engine.speculative import SpeculativeConfig
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams

ASKS = ["Write a story about a lighthouse keeper.", "Explain how a hash map works.",
        "List ten fruits and their colours.", "What is the capital of France? Explain its history."]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def outputs(cfg: EngineConfig, asks: list[str], tokens: int) -> tuple[list[list[int]], str]:
    llm = LLM(cfg, log=lambda m: None)
    tok, paged = llm.engine.tokenizer, llm.engine.model.paged
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": a}]), add_special_tokens=False)
               for a in asks]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    out = [llm.generate([p], params)[0].token_ids for p in prompts]
    return out, f"{paged.inference_precision} compute, {paged.layout.key_type.get_type_name()} KV"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in model")
    ap.add_argument("--precisions", default="bf16/,f32/,f32/f32",
                    help="COMPUTE/KV pairs, comma-separated; an empty side is the plugin's default")
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    text = stdlib_english()
    asks = [f"Repeat this text exactly: {text[i * 700:i * 700 + 600]}" for i in range(4)] + ASKS
    for pair in args.precisions.split(","):
        compute, _, kv = pair.partition("/")
        base = EngineConfig(model=args.model, kv_cache_size_gb=0.3, enable_prefix_caching=False, speculative=None,
                            compile=CompileOptions(inference_precision=compute or None, kv_cache_precision=kv or None))
        plain, what = outputs(base, asks, args.tokens)
        spec, _ = outputs(replace(base, speculative=SpeculativeConfig.parse(NGRAM)), asks, args.tokens)
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(plain, spec)]
        print(f"{what}: {sum(f is None for f in first)} of {len(first)} outputs identical; "
              f"first differing token of the others: {[f for f in first if f is not None]}")


if __name__ == "__main__":
    main()
