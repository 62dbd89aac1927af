"""`vinoserve serve`: flags (each also read from VINOSERVE_<FLAG>) -> uvicorn."""
from __future__ import annotations

import argparse
import logging
import signal

import uvicorn

from vinoserve.engine.llm_engine import EngineConfig
from vinoserve.server.app import ServerConfig, create_app


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: model dir name)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one batch at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="tokens in one step at most")
    p.add_argument("--max-queue", type=int, default=None,
                   help="reject with 503 when this many requests already wait (default: no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests to finish")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def serve(args: argparse.Namespace, engine: EngineConfig) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig(engine, args.served_model_name, args.api_key, args.max_queue,
                          generation_config=args.generation_config,
                          override_generation_config=args.override_generation_config)
    # uvicorn drains in-flight requests on SIGTERM, then re-raises the signal under the handler
    # that was there before it; a no-op one makes a graceful stop exit 0, as orchestrators expect.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.Server(uvicorn.Config(create_app(config), host=args.host, port=args.port, log_level=args.log_level,
                                  timeout_graceful_shutdown=args.shutdown_timeout)).run()
