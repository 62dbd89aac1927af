"""`vinoserve serve`: flags (each also read from VINOSERVE_<FLAG>) -> uvicorn."""
from __future__ import annotations

import argparse
import logging
import signal

import uvicorn

from vinoserve.engine.llm_engine import EngineConfig
from vinoserve.scheduler.scheduler import SchedulerConfig
from vinoserve.server.app import ServerConfig, create_app
from vinoserve.server import reasoning, tools
from vinoserve.server.limits import Limits
from vinoserve.server.media import MediaPolicy

IMAGE_REQUEST_BYTES = 32 * 2**20


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1 endpoints")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: model dir name)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one batch at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens,
                   help="tokens in one step at most: the prefill chunk beside running decodes; larger barely "
                        "changes throughput or TTFT on CPU and stalls every running stream longer")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="over capacity: answer 503 with Retry-After when this many requests already wait")
    d = Limits()
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="larger request bodies get 413 (default: 4 MiB; 32 MiB for a model served with its "
                        "vision projector, whose requests carry images as data: URLs)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longer prompts get 400 (default: only the model's context length bounds them)")
    p.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings, help="more `stop` strings get 400")
    p.add_argument("--max-n", type=int, default=d.max_n, help="a larger `n` gets 400")
    p.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="more top logprobs per token get 400 (20 at most)")
    p.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                   help="hosts (and their subdomains) whose http(s) image URLs the server fetches; by default "
                        "images come only as data: URLs")
    p.add_argument("--max-images", type=int, default=MediaPolicy.max_images,
                   help="images one request may hold (more get 400)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the model's")
    p.add_argument("--tool-call-parser", default="auto", choices=tools.CHOICES,
                   help="the format tool calls are written in: hermes (Qwen, Hermes), llama3_json (Llama 3.x), "
                        "mistral, harmony (gpt-oss), or generic (a JSON reply any model can be held to); auto (default) detects it "
                        "from the chat template, else generic")
    p.add_argument("--reasoning-parser", default="auto", choices=reasoning.CHOICES,
                   help="split a reasoning model's <think>...</think> (gpt-oss: its analysis channel, harmony) off into "
                        "reasoning_content: auto (default) "
                        "detects the family from the chat template, none turns it off")
    p.add_argument("--encoder-threads", type=int, default=None,
                   help="inference threads of each embedder and reranker (default: all cores; fewer leaves "
                        "cores to the chat model's decoding while embeddings run)")
    p.add_argument("--encoder-share", type=_share, default=ServerConfig.encoder_share,
                   help="while the chat model decodes, the share of the time each embedder or reranker may "
                        "compute (in slices of ~20 ms), and the vision tower (a frame at a time), so embedding "
                        "and image traffic never stalls decoding for long; 1 lets them run flat out beside it "
                        "(default: 0.25)")
    p.add_argument("--max-stored-responses", type=int, default=ServerConfig.max_stored_responses,
                   help="responses /v1/responses keeps in memory for previous_response_id and GET (least recently "
                        "used dropped first; 0 keeps none)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests to finish")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def serve(args: argparse.Namespace, engine: EngineConfig) -> int:
    """Runs until stopped; the exit status is 1 if the model failed to load or the engine died, else 0."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limits = Limits(request_bytes(args.max_request_bytes, engine), args.max_prompt_tokens, args.max_stop_strings,
                    args.max_n, args.max_logprobs)
    config = ServerConfig(engine, api_key=args.api_key, max_queue=args.max_queue, limits=limits,
                          generation_config=args.generation_config,
                          override_generation_config=args.override_generation_config,
                          chat_template=_read_template(args.chat_template), tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser, max_stored_responses=args.max_stored_responses,
                          media=MediaPolicy(frozenset(d.lower().rstrip(".") for d in args.allowed_media_domains),
                                            max_images=args.max_images),
                          **_models(args))
    # uvicorn drains in-flight requests on SIGTERM, then re-raises the signal under the handler
    # that was there before it; a no-op one makes a graceful stop exit 0, as orchestrators expect.
    signal.signal(signal.SIGTERM, lambda *_: None)
    died: list[str] = []

    def stop(reason: str) -> None:
        logging.getLogger("vinoserve").critical("%s; exiting with status 1", reason)
        died.append(reason)
        server.should_exit = True

    server = uvicorn.Server(uvicorn.Config(create_app(config, on_fatal=stop), host=args.host, port=args.port,
                                           log_level=args.log_level,
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    server.run()
    return 1 if died else 0


def _models(args: argparse.Namespace) -> dict:
    """ServerConfig's fields for the models --model named (cli.main sorted them into args.models)."""
    models = args.models
    name = args.served_model_name or (models.chat[0] if models.chat else None)
    return {"served_model_name": name, "chat_model": models.chat is not None, "encoders": models.encoders,
            "encoder_threads": args.encoder_threads, "encoder_share": args.encoder_share}


def _read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {path}: {e}") from e


def _share(text: str) -> float:
    """A share of the time, in (0, 1]: 0 would never let an encoder run."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def request_bytes(flag: int | None, engine: EngineConfig) -> int:
    """--max-request-bytes, else the default for the model: a few screenshots as base64 data: URLs
    (a 2560x1440 PNG is 3-6 MB, a third more encoded) need more than text's 4 MiB."""
    if flag is not None:
        return flag
    return IMAGE_REQUEST_BYTES if engine.projector is not None else Limits.max_request_bytes
