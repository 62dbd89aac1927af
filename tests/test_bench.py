"""The load-testing harness: against our own server, against a faulty one, and its arithmetic."""
from __future__ import annotations

import json
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from gguf_fixtures import tiny_hf_model, write_gguf
from server_process import ServerProcess, free_port
from vinoserve.bench.metrics import Goodput, RequestRecord, percentiles, summarize
from vinoserve.cli import main

SUMMARY_KEYS = {"duration_s", "completed", "failed", "errors", "total_input_tokens", "total_output_tokens",
                "request_throughput", "input_token_throughput", "output_token_throughput", "ttft_ms", "tpot_ms",
                "itl_ms", "e2el_ms", "goodput", "request_rate", "max_concurrency", "total_cached_tokens"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    gguf = write_gguf(tiny_hf_model("llama"), tmp_path_factory.mktemp("bench") / "tiny.gguf")
    srv = ServerProcess("--model", str(gguf), "--kv-cache-size", "0.05").wait_ready()
    yield srv
    assert srv.terminate() == 0


def test_against_our_server(server, tmp_path):
    out = tmp_path / "result.json"
    assert main(["bench", "serve", "--base-url", server.url, "--model", "tiny", "--num-prompts", "8",
                 "--input-len", "20", "--output-len", "12", "--max-concurrency", "4",
                 "--goodput", "ttft:60000,tpot:60000", "--save-result", str(out)]) == 0
    result = json.loads(out.read_text())
    run = result["runs"][0]
    s = run["summary"]
    assert set(s) == SUMMARY_KEYS and s["completed"] == 8 and s["failed"] == 0
    assert s["total_output_tokens"] == 8 * 12 and s["goodput"] > 0
    for r in run["requests"]:
        assert r["output_tokens"] == 12 and r["prompt_tokens"] > 0
        ttft, e2e = r["chunk_times"][0] - r["start"], r["end"] - r["start"]
        assert 0 < ttft <= e2e
        assert len(r["chunk_times"]) - 1 == r["output_tokens"] - 1  # one ITL per token after the first


def test_multi_turn_conversations_send_turns_in_order_and_hit_the_prefix_cache(server, tmp_path, capsys):
    out = tmp_path / "result.json"
    assert main(["bench", "serve", "--base-url", server.url, "--model", "tiny", "--workload", "multi-turn",
                 "--num-prompts", "2", "--turns", "3", "--prefix-len", "20", "--input-len", "4",
                 "--output-len", "4", "--save-result", str(out)]) == 0
    assert "TTFT, follow-ups" in capsys.readouterr().out
    run = json.loads(out.read_text())["runs"][0]
    s, reqs = run["summary"], run["requests"]
    assert s["completed"] == 6 and s["total_cached_tokens"] > 0, s["errors"]
    for conv in (reqs[:3], reqs[3:]):
        assert [r["turn"] for r in conv] == [0, 1, 2]
        assert all(a["end"] <= b["start"] for a, b in zip(conv, conv[1:])), "a turn starts after the last ends"
        assert conv[0]["prompt_tokens"] < conv[1]["prompt_tokens"] < conv[2]["prompt_tokens"]
        assert conv[0]["cached_tokens"] == 0 and conv[2]["cached_tokens"] >= 32


def test_sweep_over_concurrency(server, capsys):
    assert main(["bench", "serve", "--base-url", server.url, "--model", "tiny", "--num-prompts", "6",
                 "--input-len", "10", "--output-len", "4", "--sweep", "1,3"]) == 0
    printed = capsys.readouterr().out
    assert "concurrency 1" in printed and "concurrency 3" in printed


def _faulty_app(bodies: list[dict]) -> Starlette:
    count = {"n": 0}

    async def completions(request):
        body = await request.json()
        bodies.append(body)
        count["n"] += 1
        n = count["n"]
        if n % 3 == 0:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)

        async def events():
            for _ in range(3):
                yield 'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
                if n % 3 == 1:
                    raise RuntimeError("connection dropped mid-stream")
            usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        assert body["stream"] is True
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def test_errors_and_dropped_connections_are_counted_and_sampling_is_sent(tmp_path):
    port, bodies = free_port(), []
    server = uvicorn.Server(uvicorn.Config(_faulty_app(bodies), host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        out = tmp_path / "faulty.json"
        assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m",
                     "--num-prompts", "9", "--input-len", "5", "--output-len", "3", "--max-concurrency", "1",
                     "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5", "--save-result", str(out)]) == 0
        result = json.loads(out.read_text())
        assert (result["temperature"], result["top_p"], result["top_k"]) == (0.7, 0.9, 5)
        assert len(bodies) == 9 and all((b["temperature"], b["top_p"], b["top_k"]) == (0.7, 0.9, 5) for b in bodies)
        s = result["runs"][0]["summary"]
        assert (s["completed"], s["failed"]) == (3, 6)
        assert any("HTTP 500" in e for e in s["errors"]) and len(s["errors"]) >= 2
    finally:
        server.should_exit = True
        thread.join(5)


def test_metric_arithmetic_on_hand_made_timestamps():
    a = RequestRecord(start=0.0, chunk_times=[0.5, 0.6, 0.8], end=0.8, prompt_tokens=10, output_tokens=3)
    b = RequestRecord(start=1.0, chunk_times=[1.2, 1.3], end=1.3, prompt_tokens=20, output_tokens=2)
    failed = RequestRecord(start=2.0, error="HTTP 500")
    s = summarize([a, b, failed], duration=2.0, goodput=Goodput.parse("ttft:300"))
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["ttft_ms"]["mean"] == pytest.approx(350) and s["ttft_ms"]["median"] == pytest.approx(350)
    assert s["tpot_ms"]["mean"] == pytest.approx((150 + 100) / 2)  # (0.8-0.5)/2 and (1.3-1.2)/1
    assert sorted(a.itls + b.itls) == pytest.approx([0.1, 0.1, 0.2])
    assert s["e2el_ms"]["p99"] == pytest.approx(800 - 0.01 * 500)
    assert s["output_token_throughput"] == pytest.approx(2.5) and s["request_throughput"] == pytest.approx(1.0)
    assert s["goodput"] == pytest.approx(0.5)  # only b meets TTFT <= 300 ms
    p = percentiles([0.001 * i for i in range(1, 101)])
    assert p["median"] == pytest.approx(50.5) and p["p90"] == pytest.approx(90.1)
    with pytest.raises(ValueError, match="ttft, tpot or e2el"):
        Goodput.parse("latency:5")


def test_llamacpp_comparison_starts_with_the_servers_weight_format():
    """`vinoserve bench llamacpp` compares the format users get first (issue 29)."""
    import argparse

    from vinoserve.bench.llamacpp import add_arguments
    from vinoserve.engine.llm_engine import EngineConfig

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert ap.parse_args([]).weight_formats.split(",")[0] == EngineConfig().weight_format == "auto"


def test_random_llama_models_are_written_with_the_real_tokenizer(smollm2_gguf, tmp_path, monkeypatch):
    """The bench's real-size random models (here a tiny shape in their place): the shape's
    config, every matrix in the asked type, SmolLM2's vocabulary."""
    import gguf

    from vinoserve.bench import random_models
    from vinoserve.model.gguf_loader import GGUFModel

    monkeypatch.setitem(random_models.SHAPES, "tiny", (64, 2, 4, 2, 96))
    path = random_models.write(tmp_path / "m.gguf", "tiny", random_models.one_type(gguf.GGMLQuantizationType.Q4_0),
                               log=lambda m: None)
    src = GGUFModel.open(path)
    cfg = src.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (64, 2, 4, 2, 96)
    assert cfg.vocab_size == 49152 and not cfg.tie_word_embeddings
    assert {t.tensor_type.name for t in src.reader.tensors if len(t.shape) == 2} == {"Q4_0"}
    assert random_models.resolve("not-a-random-model") == "not-a-random-model"


def test_the_decode_bound_counts_every_tensor_but_an_untied_token_table(smollm2_gguf, tmp_path, monkeypatch):
    """A one-token step reads every matrix and the output head once, one row of the token table."""
    import gguf

    from vinoserve.bench import random_models
    from vinoserve.bench.read_rate import bound_line, decode_step_bytes
    from vinoserve.model.gguf_file import open_gguf

    monkeypatch.setitem(random_models.SHAPES, "tiny", (64, 2, 4, 2, 96))
    path = random_models.write(tmp_path / "m.gguf", "tiny", random_models.one_type(gguf.GGMLQuantizationType.Q4_0),
                               log=lambda m: None)
    sizes = {t.name: int(t.n_bytes) for t in open_gguf(path).tensors}
    assert "output.weight" in sizes and sizes["token_embd.weight"] > 0
    assert decode_step_bytes(path) == sum(sizes.values()) - sizes["token_embd.weight"]
    assert decode_step_bytes(smollm2_gguf) == sum(int(t.n_bytes) for t in open_gguf(smollm2_gguf).tensors)  # tied
    line = bound_line(path, 10.0, {"a": 2 * decode_step_bytes(path) / 10.0 / 1e6})
    assert line.endswith("(2.00x)")


def test_the_decode_bound_counts_the_routed_share_of_the_experts(smollm2_gguf, tmp_path, monkeypatch):
    """A token reads expert_used_count of expert_count experts' matrices."""
    import gguf

    from vinoserve.bench import random_models
    from vinoserve.bench.read_rate import decode_step_bytes
    from vinoserve.model.gguf_file import open_gguf

    monkeypatch.setitem(random_models.MOE_SHAPES, "tiny", random_models.Shape("qwen3moe", 64, 2, 4, 2, 32, 96, 1e6, 8, 2, "head"))
    path = random_models.write(tmp_path / "m.gguf", "tiny", random_models.one_type(gguf.GGMLQuantizationType.Q4_0),
                               log=lambda m: None)
    sizes = {t.name: int(t.n_bytes) for t in open_gguf(path).tensors}
    experts = sum(n for name, n in sizes.items() if name.endswith("_exps.weight"))
    assert experts > 0
    assert decode_step_bytes(path) == pytest.approx(sum(sizes.values()) - sizes["token_embd.weight"] - experts * 6 / 8)
