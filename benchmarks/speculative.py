"""Speculative decoding, paired in one process: the same requests through an engine without
speculation and one with it, interleaved, each measurement repeated; generated tokens per second
and the ratio, with the acceptance figures.

  copy    chat requests that rewrite a piece of this repository's source (rename a function,
          output the whole file): the model copies most of its input, so prompt lookup pays
  quote   a question answered from retrieved passages, quoting the one that answers it (RAG)
  extract fields pulled out of a document as JSON (extraction, summary-like rewrites)
  agent   an agent's turn after a tool's output: report what the tool printed
  free    chat requests to write something new: little to copy (where a draft model may pay)
  random  random token prompts, ignore_eos: nothing to look up, proposals are rare

    python benchmarks/speculative.py --workload copy --streams 1,4 --repeats 3
    python benchmarks/speculative.py --workload random --streams 64 --input-len 256 --out 128
    python benchmarks/speculative.py --workload copy,free --streams 1 --out 128 \\
        --spec '{"method": "draft_model", "model": "default", "weight_format": "int8"}'
    python benchmarks/speculative.py --workload copy --streams 1 --weight-format int8 --llamacpp

--llamacpp adds llama.cpp (xllamacpp, pip install 'vinoserve[bench]') on the same GGUF and token
ids, one request at a time, beside them (it has no prompt lookup of its own in this loop).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.engine.speculative import SpeculativeConfig
from vinoserve.model.default_model import DEFAULT_MODEL
from vinoserve.model.compile_options import CompileOptions
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig

FREE = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Describe a day at a busy market in a small mountain town.",
        "Explain to a child how a bicycle stays upright.",
        "Write a letter from a sailor to his sister about the first week at sea."]
SOURCES = ["vinoserve/cache/block_allocator.py", "vinoserve/cache/block_manager.py", "vinoserve/engine/outputs.py",
           "vinoserve/scheduler/sequence.py", "vinoserve/engine/ngram_proposer.py", "vinoserve/cache/kv_cache.py",
           "vinoserve/server/limits.py", "vinoserve/engine/detokenize.py"]


def copy_prompts(engine: LLMEngine, n: int, chars: int) -> list[list[int]]:
    root = Path(__file__).resolve().parent.parent
    tok, prompts = engine.tokenizer, []
    for i in range(n):
        code = (root / SOURCES[i % len(SOURCES)]).read_text()[:chars]
        ask = f"Add a comment at the top of this code, then output the whole code unchanged:\n\n{code}"
        prompts.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": ask}]),
                                  add_special_tokens=False))
    return prompts


def _chat(engine: LLMEngine, messages: list[dict]) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def _passages(i: int, chars: int) -> list[str]:
    """Paragraphs of real English text (the standard library's documentation), a different run each i."""
    from vinoserve.bench.workloads import stdlib_english

    paras = [p.strip() for p in stdlib_english().split("\n\n") if len(p.strip()) > 200]
    return [p[:chars // 3] for p in paras[3 * i:3 * i + 3]]


def quote_prompts(engine: LLMEngine, n: int, chars: int) -> list[list[int]]:
    out = []
    for i in range(n):
        docs = _passages(i, chars)
        context = "\n\n".join(f"[{k + 1}] {d}" for k, d in enumerate(docs))
        ask = (f"Answer from these passages, quoting the passage that answers word for word.\n\n{context}\n\n"
               f"Question: what does passage [2] say? Quote it.")
        out.append(_chat(engine, [{"role": "user", "content": ask}]))
    return out


def extract_prompts(engine: LLMEngine, n: int, chars: int) -> list[list[int]]:
    out = []
    for i in range(n):
        doc = _passages(i, 3 * chars)[0]
        ask = (f"Extract from this text a JSON object with keys \"first_sentence\", \"last_sentence\" and "
               f"\"keywords\" (the sentences copied exactly):\n\n{doc}")
        out.append(_chat(engine, [{"role": "user", "content": ask}]))
    return out


def agent_prompts(engine: LLMEngine, n: int, chars: int) -> list[list[int]]:
    root = Path(__file__).resolve().parent.parent
    out = []
    for i in range(n):
        listing = (root / SOURCES[i % len(SOURCES)]).read_text()[:chars]
        out.append(_chat(engine, [
            {"role": "user", "content": f"Show me the start of {SOURCES[i % len(SOURCES)]}."},
            {"role": "assistant", "content": f"Running: head -c {chars} {SOURCES[i % len(SOURCES)]}"},
            {"role": "user", "content": f"Tool output:\n{listing}\n\nNow show the user that output as it is, "
                                        f"in a code block."}]))
    return out


def random_prompts(engine: LLMEngine, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, engine.model.config.vocab_size - 100, length).tolist() for _ in range(n)]


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """Seconds from first add to last token, tokens generated (all prompts arrive together)."""
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}-{start}", p, params)
    tokens = 0
    while engine.has_unfinished_requests:
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return time.perf_counter() - start, tokens


def free_prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": FREE[i % len(FREE)]}]),
                       add_special_tokens=False) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="copy", help="copy, quote, extract, agent, free, random, or several comma-separated")
    ap.add_argument("--streams", default="1,4", help="concurrent requests, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=1,
                    help="at streams=1: this many different prompts of the workload, run one after another "
                         "(one prompt's reply is one sample of how much a model copies)")
    ap.add_argument("--out", type=int, default=256, help="max tokens per request")
    ap.add_argument("--input-len", type=int, default=256, help="random workload: prompt tokens")
    ap.add_argument("--chars", type=int, default=1500, help="copy workload: source characters per prompt")
    ap.add_argument("--model", default=None, help="default: the built-in model")
    ap.add_argument("--weight-format", default="f16")
    ap.add_argument("--inference-precision", default=None)
    ap.add_argument("--spec", default='{"method": "ngram"}',
                    help="--speculative-config JSON for the speculating engine (default: the server's; a draft \"model\": \"default\" "
                         "is the target's model)")
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--llamacpp", action="store_true", help="llama.cpp's single-stream figure beside ours")
    args = ap.parse_args()

    spec = SpeculativeConfig.parse(args.spec)
    if spec.model == "default":
        spec = replace(spec, model=args.model or DEFAULT_MODEL.name)
    base = EngineConfig(model=args.model, weight_format=args.weight_format, kv_cache_size_gb=1.0,
                        compile=CompileOptions(inference_precision=args.inference_precision),
                        scheduler=SchedulerConfig(max_num_batched_tokens=args.budget), enable_prefix_caching=False,
                        speculative=None)
    engines = {"plain": LLMEngine(base, log=lambda m: None),
               "spec": LLMEngine(replace(base, speculative=spec), log=lambda m: None)}
    llama = None
    if args.llamacpp:
        from vinoserve.bench.llamacpp import LlamaCpp

        llama = LlamaCpp(args.model or DEFAULT_MODEL.name)
    print(f"speculative config: {json.dumps(spec.__dict__)}")
    cost = engines["spec"].speculator.cost
    if (fit := cost.fit()) is not None:  # measured at its start, or kept from an earlier one (engine/calibration.py)
        print(f"step costs: {fit[0] * 1e3:.2f} ms + {fit[1] * 1e3:.3f} ms a token, "
              f"an overlapped plain step {cost.overlap_saving() * 1e3:.2f} ms less")
    for workload in args.workload.split(","):
        params = SamplingParams(max_tokens=args.out, temperature=0, ignore_eos=workload == "random")
        for streams in (int(s) for s in args.streams.split(",")):
            n = args.samples if streams == 1 else streams
            prompts = {"copy": lambda: copy_prompts(engines["plain"], n, args.chars),
                       "free": lambda: free_prompts(engines["plain"], n),
                       "quote": lambda: quote_prompts(engines["plain"], n, args.chars),
                       "extract": lambda: extract_prompts(engines["plain"], n, args.chars),
                       "agent": lambda: agent_prompts(engines["plain"], n, args.chars),
                       "random": lambda: random_prompts(engines["plain"], n, args.input_len)}[workload]()
            batches = [[p] for p in prompts] if streams == 1 else [prompts]
            print(f"{workload} streams={streams}" + (f" x {n} prompts" if streams == 1 and n > 1 else "") + ": "
                  + measure(engines, batches, params, args.repeats, llama if streams == 1 else None))


def measure(engines: dict[str, LLMEngine], batches: list[list[list[int]]], params: SamplingParams, repeats: int,
            llama=None) -> str:
    """Both engines (and llama.cpp, single prompts) alternating run by run, each run every batch
    of prompts in turn (the prompts of a batch arrive together); the figures as a line."""
    for engine in engines.values():  # warm up
        run(engine, batches[0][:1], replace(params, max_tokens=4))
    rates: dict[str, list[float]] = {name: [] for name in engines}
    before = replace(engines["spec"].speculator.stats)
    for _ in range(repeats):
        for name, engine in engines.items():
            seconds, tokens = map(sum, zip(*(run(engine, batch, params) for batch in batches)))
            rates[name].append(tokens / seconds)
    s = engines["spec"].speculator.stats
    drafts, proposed, accepted = (s.num_drafts - before.num_drafts, s.num_draft_tokens - before.num_draft_tokens,
                                  s.num_accepted_tokens - before.num_accepted_tokens)
    ratios = [a / b for a, b in zip(rates["spec"], rates["plain"])]
    line = (f"plain {statistics.median(rates['plain']):.1f} tok/s, spec {statistics.median(rates['spec']):.1f} tok/s, "
            f"ratio {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]; proposals {drafts}, "
            f"tokens proposed {proposed}, accepted {accepted} ({accepted / max(proposed, 1):.0%}), "
            f"mean acceptance length {1 + accepted / max(drafts, 1):.2f}")
    if llama is not None:  # generated tokens per second, prompt included, as `run` counts ours
        rounds = [[llama.generate(batch[0], params.max_tokens) for batch in batches] for _ in range(repeats)]
        rate = statistics.median(sum(t.output_tokens for t in r) / sum(t.ttft_s + t.decode_s for t in r) for r in rounds)
        line += f"; llama.cpp {rate:.1f} tok/s"
    return line


if __name__ == "__main__":
    main()
