"""`vinoserve bench vision`: issue 58's speed targets for images, against llama.cpp's server with
the same text GGUF + mmproj on the same machine in the same run.

TTFT: a one-image chat request (a PNG of random pixels, a new one each round so no engine reuses
an encoded image, plus a short question), `max_tokens` 1 by default, not streamed: its latency is
the time to the first token (image decode, vision tower, prefill, one sampling step). Both
servers are driven over HTTP by the same client (llama.cpp's through xllamacpp, which serves it),
rounds alternating which engine goes first; the report gives each engine's median and the median
[25th, 75th percentile] of the per-round ratios vinoserve / llama.cpp (the target: <= 1).

TPOT beside images (vinoserve alone): `--streams` streaming completions decode, first alone, then
again while one-image chat requests arrive one after another until they finish, then beside text
prompts of the image requests' length (what prefilling them costs the streams, without a vision
tower); the report gives the streams' median time per output token in each phase and the ratios
to alone's (the target: <= 1.5 beside images).

    vinoserve bench vision                                        # SmolVLM-500M shape, random weights
    vinoserve bench vision --model llava-1.5-7b-q4_0-random --rounds 5
    vinoserve bench vision --model m.gguf --mmproj mmproj-m.gguf --mode tpot
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from vinoserve.bench import random_vlm
from vinoserve.bench.client import Target, send
from vinoserve.bench.server_process import launch_server, stop_server
from vinoserve.bench.workloads import BenchRequest, stdlib_english

QUESTION = "Describe this image in one sentence."


@dataclass(frozen=True)
class Phase:
    """The decoding streams of one TPOT phase and the image requests answered meanwhile."""
    tpot_s: list[float]  # per stream: (last token - first token) / (tokens - 1)
    images: int  # requests answered beside the streams
    starts: tuple[float, ...] = ()  # when each was sent, seconds after the streams


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smolvlm-500m-q8_0-random",
                    help=f"a random VLM ({', '.join(random_vlm.names()[:2])}, ...) or a text .gguf")
    ap.add_argument("--mmproj", default=None, help="the .gguf model's projector (default: the mmproj*.gguf beside it)")
    ap.add_argument("--mode", choices=("ttft", "tpot", "both"), default="both")
    ap.add_argument("--rounds", type=int, default=3, help="TTFT: paired rounds")
    ap.add_argument("--image-size", default="640x480", metavar="WxH", help="the PNG's size")
    ap.add_argument("--max-tokens", type=int, default=1, help="TTFT: tokens per image request")
    ap.add_argument("--threads", type=int, default=None, help="threads for both engines (default: all CPUs)")
    ap.add_argument("--streams", type=int, default=4, help="TPOT: decoding streams")
    ap.add_argument("--stream-tokens", type=int, default=64, help="TPOT: tokens each stream decodes")
    ap.add_argument("--no-llamacpp", dest="llamacpp", action="store_false", help="vinoserve alone")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="an extra `vinoserve serve` argument (repeat: --serve-arg=--encoder-share --serve-arg=0.5)")


def image_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--image-size {text!r}: write WIDTHxHEIGHT, e.g. 640x480") from None
    if w < 1 or h < 1:
        raise ValueError(f"--image-size {text!r}: both sides must be positive")
    return w, h


def model_files(model: str, mmproj: str | None) -> tuple[str, str]:
    """(text GGUF, mmproj GGUF): a random VLM's (written if missing), or the given files."""
    found = random_vlm.resolve(model)
    if found is not None:
        return found
    from vinoserve.model.vision.serving import find_mmproj

    projector = find_mmproj(model, mmproj)
    if not model.endswith(".gguf") or not Path(model).is_file() or projector is None:
        raise ValueError(f"--model {model!r}: neither a random VLM nor a .gguf with its mmproj (--mmproj, or one "
                         "mmproj*.gguf beside it); llama.cpp needs both files")
    return model, str(projector)


def png_data_url(size: tuple[int, int], seed: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def served_model(client: httpx.Client, base_url: str) -> str:
    """The id a server answers to (vinoserve checks it; llama.cpp names its file)."""
    return client.get(f"{base_url}/v1/models").raise_for_status().json()["data"][0]["id"]


def image_request(url: str, max_tokens: int, model: str) -> dict:
    return {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": QUESTION}]}]}


def ask(client: httpx.Client, base_url: str, body: dict) -> float:
    """Seconds for one chat request, answered in full (non-streaming)."""
    start = time.perf_counter()
    r = client.post(f"{base_url}/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{base_url}: HTTP {r.status_code}: {r.text[:300]}")
    return time.perf_counter() - start


def ttft_rounds(servers: dict[str, str], size: tuple[int, int], rounds: int, max_tokens: int,
                on_round=None) -> dict[str, list[float]]:
    """Each server once a round on that round's image, the order reversed every other round; a
    warm-up request each first (compilation and first allocations stay out)."""
    times: dict[str, list[float]] = {name: [] for name in servers}
    names = list(servers)
    with httpx.Client(timeout=3600) as client:
        models = {name: served_model(client, url) for name, url in servers.items()}
        for name in names:
            ask(client, servers[name], image_request(png_data_url(size, 10_000), max_tokens, models[name]))
        for r in range(rounds):
            url = png_data_url(size, r)
            for name in names if r % 2 == 0 else names[::-1]:
                times[name].append(ask(client, servers[name], image_request(url, max_tokens, models[name])))
            if on_round:
                on_round(r, {name: t[-1] for name, t in times.items()})
    return times


Beside = tuple[str, Callable[[int], dict]]  # requests sent one after another: (path, the i-th's body)


async def _phase(base_url: str, model: str, streams: int, tokens: int, beside: Beside | None,
                 at: tuple[float, ...] | None = None) -> Phase:
    """`streams` decoding `tokens` each; beside them (where given) requests one after another
    until they finish, or (`at`) each sent that many seconds after the streams, as many as `at` says."""
    target = Target(base_url, model, ignore_eos=True, timeout=3600)
    words = stdlib_english().split()
    prompts = [" ".join(words[i * 50:(i + 1) * 50]) for i in range(streams)]
    limits = httpx.Limits(max_connections=streams + 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        decoding = [asyncio.create_task(send(client, target, BenchRequest(p, tokens), t0)) for p in prompts]
        starts: list[float] = []
        while beside is not None and not all(t.done() for t in decoding) and (at is None or len(starts) < len(at)):
            if at is not None:
                await asyncio.sleep(max(0.0, t0 + at[len(starts)] - time.perf_counter()))
            starts.append(time.perf_counter() - t0)
            r = await client.post(f"{base_url}{beside[0]}", json=beside[1](len(starts)))
            if r.status_code != 200:
                raise RuntimeError(f"{beside[0]}: HTTP {r.status_code}: {r.text[:300]}")
        records = await asyncio.gather(*decoding)
    failed = [rec.error for rec in records if rec.error]
    if failed:
        raise RuntimeError(f"a stream failed: {failed[0]}")
    return Phase([(rec.chunk_times[-1] - rec.chunk_times[0]) / (len(rec.chunk_times) - 1) for rec in records],
                 len(starts), tuple(starts))


def tpot_phases(base_url: str, size: tuple[int, int], streams: int, tokens: int) -> tuple[Phase, Phase, Phase]:
    """The streams alone; beside one-image requests (each a new image: a repeated one would hit
    the prefix cache); beside as many text prompts as long as an image request's, sent when those
    were (random token ids, a new prompt each): the prefill's share of the slowdown without the
    vision tower's."""
    with httpx.Client(timeout=3600) as client:
        model = served_model(client, base_url)
        usage = client.post(f"{base_url}/v1/chat/completions",
                            json=image_request(png_data_url(size, 19_999), 1, model)).json()["usage"]
    length, rng = usage["prompt_tokens"], np.random.default_rng(0)
    images = ("/v1/chat/completions", lambda i: image_request(png_data_url(size, 20_000 + i), 1, model))
    texts = ("/v1/completions", lambda i: {"model": model, "max_tokens": 1,
                                           "prompt": rng.integers(100, 10_000, length).tolist()})
    asyncio.run(_phase(base_url, model, streams, min(tokens, 8), None))  # warm-up: the batch's shapes compiled
    alone = asyncio.run(_phase(base_url, model, streams, tokens, None))
    with_images = asyncio.run(_phase(base_url, model, streams, tokens, images))
    return alone, with_images, asyncio.run(_phase(base_url, model, streams, tokens, texts, with_images.starts))


def _llamacpp_child(conn, text: str, mmproj: str, threads: int) -> None:
    """llama.cpp's HTTP server (xllamacpp) in a process of its own: its address sent back, then
    kept until the parent says stop."""
    import xllamacpp

    os.dup2(2, 1)  # its logs go to stderr: stdout carries the report alone
    params = xllamacpp.CommonParams()
    params.model.path, params.mmproj.path = text, mmproj
    params.n_ctx, params.n_parallel = 8192, 1
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
    server = xllamacpp.Server(params)
    conn.send(server.listening_address)
    conn.recv()
    del server


class LlamaCppServer:
    def __init__(self, text: str, mmproj: str, threads: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_llamacpp_child, args=(child, text, mmproj, threads), daemon=True)
        self._process.start()
        if not self._conn.poll(600):
            raise RuntimeError("llama.cpp's server did not start within 600 s")
        self.url = self._conn.recv().rstrip("/")

    def close(self) -> None:
        self._conn.send("stop")
        self._process.join(timeout=60)


def code_paths(threads: int) -> list[str]:
    """The machine's CPU and what each engine runs on it."""
    import openvino as ov

    core = ov.Core()
    lines = [f"CPU: {core.get_property('CPU', 'FULL_DEVICE_NAME')}, {os.cpu_count()} logical CPUs, "
             f"{threads} threads per engine",
             f"vinoserve: OpenVINO {ov.get_version()}, compute {core.get_property('CPU', 'INFERENCE_PRECISION_HINT').get_type_name()}"
             f" (capabilities {', '.join(core.get_property('CPU', 'OPTIMIZATION_CAPABILITIES'))})"]
    try:
        import xllamacpp

        lines.append(f"llama.cpp: xllamacpp {getattr(xllamacpp, '__version__', '?')}, "
                     f"{xllamacpp.get_system_info().strip()}")
    except ImportError:
        lines.append("llama.cpp: not installed (pip install 'vinoserve[bench]')")
    return lines


def _median_iqr(values: list[float]) -> str:
    q1, q2, q3 = np.percentile(values, [25, 50, 75])
    return f"{q2:.2f} [{q1:.2f}, {q3:.2f}]"


def ttft_report(times: dict[str, list[float]], reference: str = "llama.cpp") -> list[str]:
    lines = [f"{'engine':<12}{'TTFT ms (median)':>18}   / {reference} per round"]
    for name, ts in times.items():
        line = f"{name:<12}{1e3 * statistics.median(ts):>18.0f}"
        if name != reference and reference in times:
            line += "   " + _median_iqr([t / r for t, r in zip(ts, times[reference])])
        lines.append(line)
    return lines


def tpot_report(alone: Phase, images: Phase, texts: Phase) -> list[str]:
    a, b, c = (statistics.median(p.tpot_s) for p in (alone, images, texts))
    return [f"TPOT ms (median of {len(alone.tpot_s)} streams): alone {1e3 * a:.1f}, beside {images.images} image "
            f"requests {1e3 * b:.1f}; ratio {b / a:.2f} (target <= 1.5)",
            (f"  beside {texts.images} text prompts as long, sent at the same times: {1e3 * c:.1f}, "
             f"ratio {c / a:.2f} (the prefill's share)")]


def main(args: argparse.Namespace) -> list[str]:
    size = image_size(args.image_size)
    text, mmproj = model_files(args.model, args.mmproj)
    threads = args.threads or os.cpu_count() or 1
    lines = code_paths(threads)
    print("\n".join(lines), flush=True)
    # a kill runs the cleanup below (else both servers outlive the bench)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    serve = ["--model", text, "--mmproj", mmproj, "--threads", str(threads), *args.serve_arg]
    try:
        with tempfile.TemporaryDirectory(prefix="vinoserve-bench-vision-") as tmp:
            proc, url = launch_server(serve, Path(tmp) / "vinoserve.log", timeout=1800)
            llama = None
            try:
                if args.llamacpp and args.mode != "tpot":
                    llama = LlamaCppServer(text, mmproj, threads)
                lines += _measure(args, size, {"vinoserve": url} | ({"llama.cpp": llama.url} if llama else {}))
            finally:
                if llama:
                    llama.close()
                stop_server(proc)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return lines


def _measure(args: argparse.Namespace, size: tuple[int, int], servers: dict[str, str]) -> list[str]:
    lines = []
    if args.mode != "tpot":
        def progress(r: int, last: dict[str, float]) -> None:
            print(f"round {r + 1}: " + ", ".join(f"{n} {1e3 * t:.0f} ms" for n, t in last.items()), flush=True)
        lines += ttft_report(ttft_rounds(servers, size, args.rounds, args.max_tokens, progress))
        print("\n".join(lines), flush=True)
    if args.mode != "ttft":
        out = tpot_report(*tpot_phases(servers["vinoserve"], size, args.streams, args.stream_tokens))
        print("\n".join(out), flush=True)
        lines += out
    return lines
