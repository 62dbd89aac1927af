"""Per-token cost of the tool formats' `auto` grammars, while a model writes an answer as text and
while it writes a call.

Under `tool_choice: auto` every token of a reply is masked, call or not: the native formats' free
text up to their opening tag (a lazy lexeme, or TEXT beside a special token), generic's JSON
`{"response": "..."}`. This feeds the same answer, and one call in each format, tokenized by the
built-in model's tokenizer (its vocabulary has no tag as a special token, so tags are text), through
each format's compiled grammar and times the mask of every step (llguidance's fill, one
sequence), medians of repeats.

    PYTHONPATH=. python benchmarks/tool_grammar_masks.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import llguidance.numpy

from vinoserve.model.default_model import fetch
from vinoserve.model.tokenizer import Tokenizer
from vinoserve.scheduler.grammar import GrammarCompiler
from vinoserve.server.tools import FORMATS, ToolPlan

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
PLAN = ToolPlan(tuple({"name": n, "parameters": CITY} for n in ("get_weather", "get_time", "get_news")), False, True)
ANSWER = ("The weather in Paris is mild today, around 18 degrees with light clouds in the afternoon. "
          "Rain is likely tomorrow evening, so take an umbrella if you go out late. ") * 3

CALL = '"name": "get_weather", "{}": {{"city": "Paris, France, near the Eiffel Tower"}}'
CALLS = {"hermes": f"<tool_call>\n{{{CALL.format('arguments')}}}\n</tool_call>",
         "llama3_json": f"{{{CALL.format('parameters')}}}",
         "mistral": f"[TOOL_CALLS][{{{CALL.format('arguments')}}}]",
         "generic": f'{{"tool_calls": [{{{CALL.format("arguments")}}}]}}'}


def mask_cost(compiler: GrammarCompiler, fmt, tokens: list[int], vocab: int) -> float:
    """Median seconds of one mask fill along `tokens`."""
    matcher = compiler.matcher(fmt.grammar(PLAN)).matcher
    mask = llguidance.numpy.allocate_token_bitmask(1, vocab)
    times = []
    for t in tokens:
        start = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - start)
        assert matcher.consume_token(t), matcher.get_error()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tok = Tokenizer.from_gguf(fetch(log=lambda m: None))
    vocab = len(tok.token_bytes)
    compiler = GrammarCompiler(tok.token_bytes, vocab, tok.eos_token_ids, sorted(tok.special_token_ids),
                               lambda s: tok.encode(s, add_special_tokens=False))
    answers = {name: ANSWER for name in FORMATS} | {"generic": json.dumps({"response": ANSWER})}
    print("CPU:", open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(" \t:"))
    print(f"{'format':>12} {'reply':>7} {'tokens':>7} {'mask us/token':>14}")
    for name, cls in FORMATS.items():
        for kind, text in (("answer", answers[name]), ("call", CALLS[name])):
            tokens = tok.encode(text, add_special_tokens=False)
            costs = [mask_cost(compiler, cls(), tokens, vocab) for _ in range(args.repeats)]
            print(f"{name:>12} {kind:>7} {len(tokens):7d} {statistics.median(costs) * 1e6:14.1f}", flush=True)


if __name__ == "__main__":
    main()
