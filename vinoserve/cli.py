"""`vinoserve` command line: prepare a model, generate from a prompt, serve, chat, bench."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from vinoserve.model.default_model import DEFAULT_MODEL
from vinoserve.model.weights import WEIGHT_FORMATS


def _model_args(p: argparse.ArgumentParser, several: bool = False) -> None:
    extra = (" Repeat it as --model NAME=PATH to serve several under those names: one chat model beside "
             "any number of embedders and rerankers (sentence-transformers or Hugging Face BERT-family "
             "directories)" if several else "")
    p.add_argument("--model", default=None, action="append" if several else "store",
                   help=f"a .gguf file, an OpenVINO IR directory (optimum-cli export), or a built-in "
                        f"name (default: {DEFAULT_MODEL.name}).{extra}")
    p.add_argument("--mmproj", default=None, metavar="GGUF",
                   help="a vision model's projector GGUF (llama.cpp's mmproj file), so that chat messages may "
                        "hold images (default: an mmproj*.gguf alone beside a --model .gguf; an "
                        "image-text-to-text export directory takes images with its own vision model)")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="auto",
                   help="how weights converted from GGUF are stored in the graph: auto keeps each quantized "
                        "tensor's own blocks as low-bit constants (floats as f16); int4 requantizes every "
                        "matrix to 4 bits; int8, f16, f32 (default: auto)")


def _compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="CPU")
    p.add_argument("--inference-precision", choices=("f32", "bf16", "f16"), default=None,
                   help="default: the device's fastest (f16 is refused on CPU: docs/serving.md); "
                        "f32 with the low-bit kernel's one compilation (--lowbit-kernel). Asked for, it is "
                        "the plugin's arithmetic throughout")
    p.add_argument("--kv-cache-precision", choices=("f32", "f16", "bf16", "u8", "u4"), default=None,
                   help="default: u8 with the decode model, f16 with the low-bit kernel's one compilation, "
                        "else bf16 where compute runs in bf16 on CPU, else the device's choice")
    p.add_argument("--decode-model", choices=("auto", "on", "off"), default="auto",
                   help="auto: on AMX CPUs computing in bf16, with low-bit weights whose two packed copies fit in "
                        "half the memory, steps of up to 16 tokens run on a second compilation (f32, int8 activations): faster "
                        "single-stream decode for a second packed copy of the weights; the KV cache is then u8. "
                        "on: on any CPU, whatever the weights' size")
    p.add_argument("--lowbit-kernel", choices=("auto", "on", "off"), default="auto",
                   help="4- and 8-bit matmuls on vinoserve's own kernel (an OpenVINO extension built with the "
                        "machine's C++ compiler on first use, cached): the decode model's on AMX CPUs; on "
                        "every other x86-64 CPU all of them, in one f32 compilation with an f16 KV cache "
                        "(and its clone with static shapes for one-token steps, sharing its weights). "
                        "auto: where it builds (any x86-64 CPU with AVX2); on: fail to start where it cannot; "
                        "off: the plugin's kernels")
    p.add_argument("--dynamic-quantization-group-size", type=int, default=None, metavar="N",
                   help="OpenVINO's DYNAMIC_QUANTIZATION_GROUP_SIZE: matmuls with low-bit weights round their "
                        "inputs to int8 per N values (faster, less exact); 0: off. Default: per CPU class "
                        "(off on AVX512_BF16 CPUs without AMX, where it costs 2-3%% perplexity; the plugin's "
                        "elsewhere)")
    p.add_argument("--threads", type=int, default=None, help="inference threads (default: all cores)")
    p.add_argument("--kv-cache-size", type=float, default=None, metavar="GB",
                   help="KV cache memory (default: a quarter of the memory available at start, "
                        "within a container's cgroup memory limit)")
    p.add_argument("--cache-eviction", default=None, metavar="START,RECENT,MAX",
                   help="evict KV blocks by attention score: keep the first START and last RECENT tokens, "
                        "cap each sequence's cache at MAX tokens (multiples of the block size, e.g. 32,128,672)")
    p.add_argument("--eviction-policy", choices=("tokens", "blocks", "streaming"), default="tokens",
                   help="tokens: the best-scoring tokens of each layer, compacted (default); blocks: whole "
                        "blocks by score (openvino-genai's); streaming: start + recent only")
    p.add_argument("--eviction-aggregation", choices=("norm_sum", "sum"), default="norm_sum")
    p.add_argument("--no-rotation", action="store_true",
                   help="never re-rotate kept keys: positions only grow, so prompt + max_tokens must fit the "
                        "context (default: tokens keep their positions until they would run past the context, "
                        "then all are rebased; the blocks and streaming policies rebase at every eviction)")
    p.add_argument("--evict-during-prefill", action="store_true",
                   help="evict after every prompt chunk too, so no sequence holds more than MAX tokens plus "
                        "one chunk, whatever its prompt's length (default: once the prompt is in)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of prompt prefixes already computed (default: on, off with --cache-eviction)")
    p.add_argument("--overlap-steps", action=argparse.BooleanOptionalAction, default=True,
                   help="set up each engine step while the one before computes, so only sampling stays "
                        "between two steps (default: on; speculation and cache eviction run one at a time)")
    p.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON|off",
                   help='speculative decoding, as vLLM names it. Default: prompt lookup, \'{"method": "ngram", '
                        '"num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\', which '
                        'proposes only where a sequence repeats its context and verifying pays; or \'{"method": '
                        '"draft_model", "model": PATH, "num_speculative_tokens": 4}\'; "off": none. No proposals '
                        'while more than "disable_by_batch_size" (default 8) sequences decode')


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


def _speculative_config(text: str) -> dict | str:
    return "off" if text.strip().lower() in ("off", "none") else _json_object(text)


def _generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--generation-config", default="auto", metavar="auto|vinoserve|DIR",
                   help="sampling defaults for fields a request leaves out: auto (default) takes the model's "
                        "(its generation_config.json, GGUF metadata, or a built-in model's recommended values); "
                        "vinoserve ignores them (OpenAI's defaults); DIR reads DIR/generation_config.json")
    p.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                   help='on top of those, e.g. \'{"temperature": 0.7, "max_new_tokens": 512}\'')


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv` (default: this process's arguments): the benchmarks' parsers, which
    import every benchmark, only when the command is `bench`."""
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

    from vinoserve.server.cli import add_serve_arguments

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _model_args(srv, several=True)
    _compile_args(srv)
    _generation_args(srv)
    add_serve_arguments(srv)
    from vinoserve.scale.cli import add_scale_arguments

    add_scale_arguments(srv)
    from vinoserve.chat import add_chat_arguments

    chat = sub.add_parser("chat", help="chat in the terminal, with a model run here or any OpenAI server (--url)")
    _model_args(chat)
    _compile_args(chat)
    _generation_args(chat)
    add_chat_arguments(chat)
    if (sys.argv[1:] if argv is None else argv)[:1] == ["bench"]:
        from vinoserve.bench.cli import add_bench_parser

        add_bench_parser(sub)
    else:
        sub.add_parser("bench", help="benchmarks (`vinoserve bench --help` lists them)")
    for p in (prepare, gen, srv, chat):
        _defaults_from_environment(p)
    return parser


def _defaults_from_environment(p: argparse.ArgumentParser) -> None:
    """Every --some-flag defaults to $VINOSERVE_SOME_FLAG when that is set (containers, k8s)."""
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = os.environ.get(f"VINOSERVE_{action.dest.upper()}")
        if value is not None:
            if isinstance(action, argparse._AppendAction):
                action.default = value.split(",")  # VINOSERVE_MODEL=chat=a.gguf,emb=dir
            elif isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
                action.default = value.lower() in ("1", "true", "yes", "on")
            else:
                action.default = action.type(value) if action.type else value


def _engine_config(args: argparse.Namespace):
    from vinoserve.cache.eviction import CacheEvictionConfig
    from vinoserve.engine.llm_engine import EngineConfig
    from vinoserve.engine.speculative import SpeculativeConfig
    from vinoserve.model.compile_options import CompileOptions
    from vinoserve.model.precision import check_inference_precision
    from vinoserve.scheduler.scheduler import SchedulerConfig

    eviction = None
    if args.cache_eviction:
        eviction = CacheEvictionConfig.parse(args.cache_eviction, args.eviction_policy,
                                             aggregation=args.eviction_aggregation,
                                             rotation=not args.no_rotation,
                                             during_prefill=args.evict_during_prefill)
    scheduler = SchedulerConfig()
    if args.command == "serve":
        scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    config = EngineConfig(
        model=args.model, mmproj=args.mmproj, weight_format=args.weight_format,
        compile=CompileOptions(args.device, args.inference_precision, args.kv_cache_precision, args.threads,
                               decode_model={"auto": None, "on": True, "off": False}[args.decode_model],
                               lowbit_kernel={"auto": None, "on": True, "off": False}[args.lowbit_kernel],
                               dynamic_quantization_group_size=args.dynamic_quantization_group_size),
        scheduler=scheduler, kv_cache_size_gb=args.kv_cache_size, cache_eviction=eviction,
        enable_prefix_caching=args.enable_prefix_caching, overlap_steps=args.overlap_steps,
        speculative=(None if args.speculative_config == "off" else
                     SpeculativeConfig.parse(args.speculative_config or {})),
    )
    _ = config.prefix_caching  # a ValueError now, not once the server is up, for flags that conflict
    check_inference_precision(config.compile)
    return config


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _prepare(args: argparse.Namespace) -> None:
    from vinoserve.model.loader import resolve_model_dir

    print(resolve_model_dir(args.model, args.weight_format, log=_log))


def _generate(args: argparse.Namespace) -> None:
    from vinoserve.engine.llm_engine import LLMEngine
    from vinoserve.scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    engine = LLMEngine(_engine_config(args), log=_log)
    tok = engine.tokenizer
    _log(f"loaded {engine.model.path.name} on {args.device} in {time.perf_counter() - start:.1f} s "
         f"({engine.model.paged.inference_precision} inference)")
    if tok.chat_template and not args.raw:
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": args.prompt}]),
                            add_special_tokens=False)
    else:
        prompt = tok.encode(args.prompt)
    engine.add_request("cli", prompt, params)
    start, count = time.perf_counter(), 0
    while engine.has_unfinished_requests:
        for out in engine.step():
            count = out.num_output_tokens
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - start
    _log(f"{len(prompt)} prompt + {count} generated tokens in {elapsed:.2f} s ({count / elapsed:.1f} tok/s)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    from vinoserve.model.errors import ModelLoadError, one_line

    try:
        if args.command == "bench":
            from vinoserve.bench.cli import main as bench

            return bench(args)
        elif args.command == "serve":
            from vinoserve.server.serving_models import parse_models

            args.models = parse_models(args.model)
            args.model = args.models.chat[1] if args.models.chat else None
            engine = _engine_config(args)
            if args.replicas < 1:
                raise ValueError("--replicas must be at least 1")
            if args.replicas > 1:
                from vinoserve.scale.supervisor import run as serve_replicas

                return serve_replicas(args, sys.argv[1:] if argv is None else argv)
            from vinoserve.server.cli import serve

            return serve(args, engine)
        elif args.command == "chat":
            from vinoserve.chat import run

            return run(args, None if args.url else _engine_config(args))
        else:
            {"prepare": _prepare, "generate": _generate}[args.command](args)
    except (ModelLoadError, ValueError, OSError) as e:
        print(f"vinoserve: error: {one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
