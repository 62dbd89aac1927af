"""`vinoserve` command line: prepare a model, generate from a prompt."""
from __future__ import annotations

import argparse
import os
import sys
import time

from vinoserve.model.default_model import DEFAULT_MODEL


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("VINOSERVE_MODEL"),
                   help=f"a .gguf file, an OpenVINO IR directory (optimum-cli export), or a built-in "
                        f"name (default: {DEFAULT_MODEL.name})")
    p.add_argument("--weight-format", choices=("f16", "int8", "f32"), default="f16",
                   help="how weights converted from GGUF are stored in the graph (default: f16)")


def _compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="CPU")
    p.add_argument("--inference-precision", choices=("f32", "bf16", "f16"), default=None,
                   help="default: the device's fastest")
    p.add_argument("--kv-cache-precision", choices=("f32", "f16", "bf16", "u8", "u4"), default=None,
                   help="default: the device's choice")
    p.add_argument("--threads", type=int, default=None, help="inference threads (default: all cores)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vinoserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    prepare = sub.add_parser("prepare", help="download/convert a model into the cache and print where it went")
    _model_args(prepare)

    gen = sub.add_parser("generate", help="generate a completion for one prompt, streamed to stdout")
    _model_args(gen)
    _compile_args(gen)
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="do not wrap the prompt in the model's chat template")
    gen.add_argument("prompt")
    return parser


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _prepare(args: argparse.Namespace) -> None:
    from vinoserve.model.loader import resolve_model_dir

    print(resolve_model_dir(args.model, args.weight_format, log=_log))


def _generate(args: argparse.Namespace) -> None:
    from vinoserve.engine.detokenize import IncrementalDetokenizer
    from vinoserve.engine.generate import GenerationConfig, generate_tokens
    from vinoserve.model.loader import load_model
    from vinoserve.model.paged import CompileOptions

    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    if args.temperature < 0:
        raise ValueError("--temperature must be >= 0")
    options = CompileOptions(args.device, args.inference_precision, args.kv_cache_precision, args.threads)
    start = time.perf_counter()
    model = load_model(args.model, options, args.weight_format, log=_log)
    tok = model.tokenizer
    _log(f"loaded {model.path.name} on {args.device} in {time.perf_counter() - start:.1f} s "
         f"({model.paged.inference_precision} inference, {model.paged.layout.key_type.get_type_name()} KV cache)")
    if tok.chat_template and not args.raw:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(args.prompt)
    eos = tuple(dict.fromkeys([*model.config.eos_token_ids, *tok.eos_token_ids]))
    cfg = GenerationConfig(args.max_tokens, args.temperature, args.seed, stop_token_ids=eos)
    detok = IncrementalDetokenizer(tok)
    start, count = time.perf_counter(), 0
    for token in generate_tokens(model.paged, ids, cfg):
        count += 1
        if token not in eos:
            sys.stdout.write(detok.add(token))
            sys.stdout.flush()
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - start
    _log(f"{len(ids)} prompt + {count} generated tokens in {elapsed:.2f} s ({count / elapsed:.1f} tok/s)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vinoserve.model.errors import ModelLoadError

    try:
        {"prepare": _prepare, "generate": _generate}[args.command](args)
    except (ModelLoadError, ValueError, FileNotFoundError) as e:
        print(f"vinoserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
