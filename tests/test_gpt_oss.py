"""gpt-oss (model/architectures/gpt_oss.py) from GGUFs written as llama.cpp's converter writes them,
experts once f16 and once MXFP4, against HF transformers' GptOssForCausalLM at f32 through the
engine: greedy tokens over staggered prompts longer than the sliding window with prefix-cache
hits, logprobs; the sinks on PagedAttention's own input, the MXFP4 experts exact and compressed
on GatherMatmul, YaRN's frequencies as HF's."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gguf_fixtures import tiny_hf_model, write_gguf
from test_architectures import F32, MAX_TOKENS, _engine, _run
from test_moe_families import (assert_llama_cpp_writes_hfs_greedy_text, assert_logprobs_equal_hfs,
                               assert_preemption_and_speculation_keep_the_tokens, staggered_case)
from vinoserve.model import quantized
from vinoserve.model.config import ExpertRouting, Gating
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.gguf_loader import GGUFModel
from vinoserve.model.graph import build_model
from vinoserve.model.graph_facts import SLIDING_WINDOW_INPUT
from vinoserve.model.paged import compile_paged, to_paged
from vinoserve.scheduler.sampling_params import SamplingParams

T = gguf.GGMLQuantizationType
WINDOW, EXPERTS, USED = 20, 4, 2
SINKS_INPUT = 20  # PagedAttention's `sinks` on openvino 2026.4.1
# Two layers: the first windowed, the second global (HF's layer_types); YaRN past a 64-token
# trained context; hidden and expert sizes multiples of MXFP4's 32-value blocks.
SPEC = dict(heads=4, kv_heads=2, head_dim=16, hidden=64, intermediate=64, rope_theta=150000.0,
            num_local_experts=EXPERTS, num_experts_per_tok=USED, sliding_window=WINDOW,
            rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                          "truncate": False, "original_max_position_embeddings": 64})


def _tiny_gpt_oss(spec: dict = SPEC):
    """The spec's model with its gate and up products 4x HF's init: past the SwiGLU's clamp at 7
    often (each value still an f16, as the file holds it)."""
    hf = tiny_hf_model("gpt_oss", **spec)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(4)
    return hf


def _mxfp4_rounded(hf) -> None:
    """In place: every expert matrix replaced by the values its MXFP4 blocks hold in the GGUF
    (rows of the file's [E, out, in] layout, 32 inputs a block)."""
    with torch.no_grad():
        for layer in hf.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                stored = p.detach().numpy().swapaxes(1, 2)
                blocks = gguf.quants.quantize(np.ascontiguousarray(stored), T.MXFP4)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, T.MXFP4).swapaxes(1, 2).copy()))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """experts' type -> (HF model, GGUF path, prompts, HF's greedy tokens)."""
    made = {}

    def get(experts: str):
        if experts not in made:
            hf = _tiny_gpt_oss()
            if experts == "MXFP4":
                _mxfp4_rounded(hf)
            path = write_gguf(hf, tmp_path_factory.mktemp(experts) / "gpt-oss.gguf", "gpt_oss",
                              expert_quant=experts if experts == "MXFP4" else None)
            made[experts] = staggered_case(hf, path, seed=5)
        return made[experts]
    return get


def test_the_file_reads_as_gpt_oss():
    """What llama.cpp fixes for the architecture where the file has no key: softmax over the top
    k's logits, every other layer windowed from the first, YaRN's ramp not rounded."""
    import tempfile

    hf = tiny_hf_model("gpt_oss", **SPEC)
    with tempfile.TemporaryDirectory() as d:
        src = GGUFModel.open(write_gguf(hf, Path(d) / "m.gguf", "gpt_oss", expert_quant="MXFP4"))
        cfg = src.config
        assert src.meta.tensor("blk.0.ffn_up_exps.weight").ggml_type == T.MXFP4
    assert cfg.experts == ExpertRouting(EXPERTS, USED, Gating.SOFTMAX_SELECTED)
    assert cfg.sliding_windows == (WINDOW, 0) and cfg.hidden_act == "swiglu_oai"
    assert cfg.rope.scaling["truncate"] is False
    np.testing.assert_allclose(cfg.rope.inverse_frequencies(), hf.model.rotary_emb.inv_freq.double().numpy(),
                               rtol=1e-6)
    assert cfg.rope.attention_factor == pytest.approx(hf.model.rotary_emb.attention_scaling)


@pytest.mark.parametrize("experts", ["F16", "MXFP4"])
def test_greedy_equals_hf_over_staggered_prompts_longer_than_the_window(gpt_oss, experts):
    """Sinks, biases, windows, YaRN, the router and the clamped SwiGLU, token for token; prompts 3
    and 5 start from prompt 1's cached blocks."""
    _, path, prompts, reference = gpt_oss(experts)
    engine = _engine(path)
    assert engine.model.config.sliding_windows == (WINDOW, 0)
    assert _run(engine, prompts) == reference
    assert engine.blocks.prefix.num_hit_tokens >= 64
    hits = engine.blocks.prefix.num_hit_tokens
    engine.add_request("again", prompts[3], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    again = []
    while engine.has_unfinished_requests:
        again += [t for o in engine.step() for t in o.new_token_ids]
    assert again == reference[3] and engine.blocks.prefix.num_hit_tokens - hits >= 96  # blocks of it cached


@pytest.mark.parametrize("experts", ["F16", "MXFP4"])
def test_logprobs_and_prompt_logprobs_equal_hfs(gpt_oss, experts):
    """Within 1e-4 of transformers' at f32, over a prompt five windows long."""
    hf, path, prompts, _ = gpt_oss(experts)
    assert_logprobs_equal_hfs(hf, path, prompts[2])


def test_preemption_and_speculation_keep_the_tokens(gpt_oss):
    """Several proposed tokens verified a step, sequences preempted and recomputed across the
    window: HF's tokens still. With a windowed and a global layer, a block holds one layer: 16
    are the memory of 8 two-layer blocks."""
    _, path, prompts, reference = gpt_oss("MXFP4")
    assert_preemption_and_speculation_keep_the_tokens(path, prompts, reference, num_blocks=16)


def test_sinks_and_windows_reach_paged_attention(gpt_oss):
    """The sinks are the op's own input (not a mask the transformation would drop): [1, H, 1, 1]
    per layer, the file's values; each layer's window set."""
    _, path, _, _ = gpt_oss("F16")
    src = GGUFModel.open(Path(path))
    model = to_paged(build_model(src.config, src.tensor, "f32"), F32, src.config.sliding_windows)
    attention = [n for n in model.get_ordered_ops() if n.get_type_name() == "PagedAttentionExtension"]
    assert len(attention) == 2
    for i, node in enumerate(attention):
        sinks = node.input_value(SINKS_INPUT).get_node()
        assert sinks.get_type_name() == "Constant"
        np.testing.assert_array_equal(sinks.get_data().reshape(-1), src.weight(f"blk.{i}.attn_sinks.weight"))
        assert node.input_value(SLIDING_WINDOW_INPUT).get_node().get_data() == (WINDOW, 0)[i]


def test_mxfp4_experts_stay_8_bit_on_gathermatmul_and_compute_the_files_values(gpt_oss):
    """MXFP4 blocks as i8 groups of 32 with f32 scales: every value exact (against gguf-py's own
    reading), every expert product on GatherMatmulCompressed, the logits those of the same values
    as f32 constants."""
    from vinoserve.cache.kv_cache import KVCache
    from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk

    _, path, prompts, _ = gpt_oss("MXFP4")
    src = GGUFModel.open(Path(path))
    t = src.meta.tensor("blk.1.ffn_down_exps.weight")
    blocks = quantized.unpack(t.ggml_type, t.data.reshape(-1, t.data.shape[-1] // EXPERTS))
    assert blocks.element.get_type_name() == "i8" and blocks.scale.dtype == np.float32
    np.testing.assert_array_equal((blocks.q * blocks.scale).reshape(t.shape), t.dequantize())
    logits = []
    for fmt in ("auto", "f32"):
        model = compile_paged(build_model(src.config, src.tensor, fmt), F32)
        runner = ModelRunner(model, KVCache(model.layout, src.config.num_layers, num_blocks=8))
        ids = prompts[3]
        logits.append(runner.step([ScheduledChunk(ids, 0, [list(range(5))], num_logits=len(ids))]).logits[0].copy())
        if fmt == "auto":
            gathered = [n for n in model.compiled.get_runtime_model().get_ordered_ops()
                        if n.get_rt_info()["layerType"].astype(str) == "GatherMatmul"]
            assert len(gathered) == 3 * 2
            assert {n.input(1).get_source_output().get_node().get_rt_info()["outputPrecisions"].astype(str)
                    for n in gathered} == {"i8"}
    np.testing.assert_allclose(logits[0], logits[1], rtol=0, atol=1e-4 * np.abs(logits[1]).max())



def test_llama_cpp_reads_our_mxfp4_file_and_differs_only_by_yarns_rounding(tmp_path):
    """The writer and the MXFP4 layout checked against llama.cpp itself: it loads the file and
    generates transformers' greedy text once HF's YaRN rounds the ramp's ends as
    ggml_rope_yarn_corr_dims always does (gpt-oss' own config does not: see gpt_oss.py)."""
    import dataclasses

    from gguf_fixtures import TINY_VOCAB

    hf = _tiny_gpt_oss({**SPEC, "rope_scaling": {**SPEC["rope_scaling"], "truncate": True}})
    _mxfp4_rounded(hf)
    vocab = dataclasses.replace(TINY_VOCAB, pre="default")
    path = write_gguf(hf, tmp_path / "m.gguf", "gpt_oss", vocab=vocab, expert_quant="MXFP4")
    assert_llama_cpp_writes_hfs_greedy_text(hf, path, vocab)


def test_an_amx_servers_compilations_run_it(gpt_oss, kernel, monkeypatch):
    """An AMX server's default for a mixture of experts (one f32 compilation, the experts on the
    low-bit kernel) and with the decode model asked for (bf16 compute, the decode model for short
    steps): the sinks and biased experts compile in every graph, a prompt's argmax as at f32, a
    decode step's among f32's top 3. (Where the CPU has no bf16 arithmetic the decode model's
    compilation is at the plugin's f32.)"""
    import openvino as ov

    from vinoserve.cache.kv_cache import KVCache
    from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk
    from vinoserve.model import cpu_defaults
    from vinoserve.model.compile_options import CompileOptions
    from vinoserve.model.cpu_class import CpuClass

    _, path, prompts, _ = gpt_oss("MXFP4")
    src = GGUFModel.open(Path(path))
    monkeypatch.setattr(cpu_defaults, "this_cpu", lambda: CpuClass.AMX)
    ids, argmax = prompts[2], []
    default = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()  # f32 where no bf16 arithmetic
    for options, precision in ((F32, "f32"), (CompileOptions(), "f32"), (CompileOptions(decode_model=True), default)):
        model = compile_paged(build_model(src.config, src.tensor, "auto"), options, sliding_windows=(WINDOW, 0))
        runner = ModelRunner(model, KVCache(model.layout, src.config.num_layers, num_blocks=8))
        prompt = runner.step([ScheduledChunk(ids, 0, [[0, 1, 2, 3]], num_logits=len(ids))]).logits[0].argmax(-1)
        step = runner.step([ScheduledChunk([int(prompt[-1])], len(ids), [[0, 1, 2, 3]], num_logits=1)])
        argmax.append((prompt, step.logits[0][0]))
        assert model.inference_precision == precision
        if options is not F32:
            assert model.decode is not None and "expert products" in model.describe()
            assert (model.main_kernel.experts or model.decode_graph.experts) == 3 * src.config.num_layers
            assert (argmax[-1][0] == argmax[0][0]).mean() >= 0.9
            assert int(argmax[-1][1].argmax()) in np.argsort(-argmax[0][1])[:3]  # bf16: near ties may swap


def test_the_benchs_random_gpt_oss_loads_as_gpt_oss_and_runs_on_gathermatmul(smollm2_gguf, tmp_path, monkeypatch):
    """`vinoserve bench engine|llamacpp --model gpt-oss-20b-mxfp4-random` (here a tiny shape in its
    place): written as the family, read back with its routing and windows, its MXFP4 experts
    products on GatherMatmul."""
    from vinoserve.bench import random_models
    from vinoserve.cache.kv_cache import KVCache
    from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk

    assert "gpt-oss-20b-mxfp4-random" in random_models.names()
    assert not any(n.startswith("gpt-oss-20b-q4") for n in random_models.names())
    monkeypatch.setitem(random_models.MOE_SHAPES, "tiny", random_models.Shape("gpt-oss", 64, 2, 4, 2, 16, 64,
                                                                             150000.0, EXPERTS, USED))
    path = random_models.write(tmp_path / "m.gguf", "tiny", random_models.mxfp4_experts(), log=lambda m: None)
    src = GGUFModel.open(path)
    assert src.config.experts == ExpertRouting(EXPERTS, USED, Gating.SOFTMAX_SELECTED)
    assert src.config.sliding_windows == (128, 0) and src.config.rope.scaling_type == "yarn"
    assert src.meta.tensor("blk.1.ffn_down_exps.weight").ggml_type == T.MXFP4
    model = compile_paged(build_model(src.config, src.tensor, "auto"), F32, sliding_windows=src.config.sliding_windows)
    kinds = [n.get_rt_info()["layerType"].astype(str) for n in model.compiled.get_runtime_model().get_ordered_ops()]
    assert kinds.count("GatherMatmul") == 3 * 2
    runner = ModelRunner(model, KVCache(model.layout, src.config.num_layers, num_blocks=2))
    assert np.isfinite(runner.step([ScheduledChunk(list(range(40)), 0, [[0, 1]], num_logits=1)]).logits[0]).all()


def test_a_file_with_fused_gate_up_experts_is_refused_by_name(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "fused.gguf"), "gpt-oss")
    w.add_block_count(1)
    w.add_tensor("blk.0.ffn_gate_up_exps.weight", np.zeros((2, 8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="fused ffn_gate_up_exps .* is not supported; convert without it"):
        GGUFModel.open(tmp_path / "fused.gguf")
