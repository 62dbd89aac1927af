"""Each mixture-of-experts family (qwen3moe, Mixtral, qwen2moe, OLMoE) from a GGUF written as
llama.cpp's converter writes it, against HF transformers at f32 through the engine: greedy tokens
over staggered prompts with prefix-cache hits, logprobs, speculation and preemption, eviction with
re-rotation; llama.cpp itself reading the same files; quantized files, the bench's random models
and each CPU class's default compilations."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from gguf_fixtures import tiny_hf_model, write_gguf
from hf_reference import hf_greedy
from test_architectures import F32, MAX_TOKENS, _engine, _run
from test_moe import EXPERTS, FFN, HIDDEN, USED
from vinoserve.cache.kv_cache import KVCache
from vinoserve.engine.model_runner import ModelRunner, ScheduledChunk
from vinoserve.model.config import ExpertRouting
from vinoserve.model.gguf_loader import GGUFModel
from vinoserve.model.graph import build_model
from vinoserve.model.paged import compile_paged
from vinoserve.scheduler.sampling_params import SamplingParams

T = gguf.GGMLQuantizationType

# Each family tiny, with several experts, top-k > 1 and two layers; what sets each apart.
MOE_FAMILIES = {
    "qwen3moe": dict(arch="qwen3_moe", head_dim=32, num_experts=EXPERTS, num_experts_per_tok=USED,
                     moe_intermediate_size=48, norm_topk_prob=True),
    # a `llama` GGUF with expert_count, Q/K rows permuted, the experts' FFN size feed_forward_length
    "mixtral": dict(arch="mixtral", num_local_experts=EXPERTS, num_experts_per_tok=2, intermediate=48),
    # Q/K/V biases, a shared expert under its sigmoid gate, top-k weights not renormalised
    "qwen2moe": dict(arch="qwen2_moe", num_experts=EXPERTS, num_experts_per_tok=USED, moe_intermediate_size=48,
                     shared_expert_intermediate_size=40),
    # norms over the whole Q and K projections, top-k weights not renormalised; no grouped-query
    # attention, as in OLMoE-1B-7B (llama.cpp sizes the K norm by the hidden size)
    "olmoe": dict(arch="olmoe", num_experts=EXPERTS, num_experts_per_tok=USED, intermediate=48, kv_heads=4),
}


@pytest.fixture(scope="module")
def moe_families(tmp_path_factory):
    """name -> (HF model, GGUF path, prompts, HF's greedy tokens), built once each."""
    made = {}

    def get(name: str):
        if name not in made:
            spec = MOE_FAMILIES[name]
            hf = tiny_hf_model(spec["arch"], **{k: v for k, v in spec.items() if k != "arch"})
            made[name] = staggered_case(hf, write_gguf(hf, tmp_path_factory.mktemp(name) / f"{name}.gguf",
                                                       spec["arch"]), seed=3)
        return made[name]
    return get


def staggered_case(hf, path, seed: int) -> tuple:
    """(HF model, GGUF path, six prompts of 5-130 tokens, 3 and 5 extending 1, HF's greedy tokens)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, hf.config.vocab_size, n).tolist() for n in (5, 70, 100, 130, 45, 90)]
    prompts[3] = prompts[1] + prompts[3][len(prompts[1]):]
    prompts[5] = prompts[1][:64] + prompts[5][64:]
    return hf, str(path), prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_greedy_equals_hf_over_staggered_prompts(moe_families, name):
    """Each family's routing defaults, attention and shared experts, token for token (dropping
    any one of them was seen to change the tokens)."""
    _, path, prompts, reference = moe_families(name)
    assert_greedy_with_prefix_hits(path, prompts, reference)


def assert_greedy_with_prefix_hits(path: str, prompts: list[list[int]], reference) -> None:
    """staggered_case's prompts through the engine at f32: `reference`, prompts 3 and 5 starting
    from prompt 1's cached blocks."""
    engine = _engine(path)
    assert _run(engine, prompts) == reference
    assert engine.blocks.prefix.num_hit_tokens >= 64, "prompts 3 and 5 should start from prompt 1's blocks"


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_logprobs_and_prompt_logprobs_equal_hfs(moe_families, name):
    """Each generated token's top-5 logprobs, and each prompt token's, within 1e-4 of transformers'
    log-softmax at f32 over the same sequence."""
    hf, path, prompts, _ = moe_families(name)
    assert_logprobs_equal_hfs(hf, path, prompts[2])


def assert_logprobs_equal_hfs(hf, path: str, prompt: list[int]) -> None:
    """8 greedy tokens' top-5 logprobs and the prompt's through the engine at f32, within 1e-4 of
    transformers' log-softmax over the same sequence."""
    import torch

    engine = _engine(path)
    engine.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0, logprobs=5, prompt_logprobs=5,
                                                   ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests:
        outs += engine.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    generated = [lp for o in outs for lp in (o.new_logprobs or [])]
    prompt_lps = next(o.prompt_logprobs for o in outs if o.prompt_logprobs)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0].double(), -1).numpy()
    start = len(prompt) - 1
    assert len(generated) == len(tokens) == 8 and len(prompt_lps) == len(prompt)
    assert all(len(entry[1]) >= 5 for entry in generated + prompt_lps[1:])  # (logprob, top[, rank])
    for row, (_, top) in zip(ref[start:], generated):
        assert max(abs(lp - row[token]) for token, lp in top) < 1e-4
    for row, entry in zip(ref[:start], prompt_lps[1:]):
        assert max(abs(lp - row[token]) for token, lp in entry[1]) < 1e-4


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_preemption_and_speculation_keep_the_tokens(moe_families, name):
    """Steps verifying several proposed tokens per sequence, and sequences preempted and recomputed
    (8 blocks' memory for six sequences of up to 150 tokens): the same tokens."""
    _, path, prompts, reference = moe_families(name)
    assert_preemption_and_speculation_keep_the_tokens(path, prompts, reference)


def assert_preemption_and_speculation_keep_the_tokens(path: str, prompts: list[list[int]], reference,
                                                      num_blocks: int = 8) -> None:
    """Greedy tokens through an engine with `num_blocks` blocks' memory (preempting) that speculates
    3 tokens by prompt lookup: `reference`, with some of each."""
    from test_speculative import eager
    from vinoserve.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1,
                             disable_by_batch_size=1024)
    engine = eager(_engine(path, num_blocks=num_blocks, speculative=spec))
    assert _run(engine, prompts) == reference
    assert engine.scheduler.num_preemptions > 0 and engine.speculator.stats.num_draft_tokens > 0


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_llama_cpp_reads_our_moe_ggufs_and_writes_transformers_greedy_text(name, tmp_path):
    """The fixture writer checked against llama.cpp itself (xllamacpp): it loads each family's file
    (names, shapes, keys) and, routing as its src/models/*.cpp do, generates transformers' greedy
    text (end-of-generation tokens masked in both, as its ignore_eos does)."""
    import dataclasses

    from gguf_fixtures import TINY_VOCAB

    spec = MOE_FAMILIES[name]
    hf = tiny_hf_model(spec["arch"], **{k: v for k, v in spec.items() if k != "arch"})
    vocab = dataclasses.replace(TINY_VOCAB, pre="default")
    assert_llama_cpp_writes_hfs_greedy_text(hf, write_gguf(hf, tmp_path / "m.gguf", spec["arch"], vocab=vocab), vocab)


def assert_llama_cpp_writes_hfs_greedy_text(hf, path, vocab) -> None:
    """llama.cpp (xllamacpp) loads the file and generates 12 tokens of transformers' greedy text
    after a 30-token prompt (end-of-generation tokens masked in both, as its ignore_eos does)."""
    import torch

    xllamacpp = pytest.importorskip("xllamacpp")
    from gguf_fixtures import BYTE_TOKENS

    params = xllamacpp.CommonParams()
    params.model.path = str(path)
    params.n_ctx, params.n_parallel = 256, 1
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = 1
    prompt = np.random.default_rng(3).integers(0, hf.config.vocab_size, 30).tolist()
    reply: dict = {}
    xllamacpp.Server(params).handle_completions(
        {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "cache_prompt": False},
        lambda chunk: reply.update(chunk) or False)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            logits[len(BYTE_TOKENS) + 2:] = -float("inf")  # <|endoftext|>, <|im_end|>
            ids.append(int(logits.argmax()))
    byte = {ch: i for i, ch in enumerate(BYTE_TOKENS)}
    text = b"".join(bytes(byte[c] for c in vocab.tokens[i]) for i in ids[len(prompt):]).decode("utf-8", "replace")
    assert reply["choices"][0]["text"] == text


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K"])
def test_quantized_experts_compute_the_files_values(qtype, tmp_path):
    """A quantized MoE GGUF kept compressed (`auto`) gives the logits of the same file's values
    as f32 constants, within f32 rounding."""
    spec = {k: v for k, v in MOE_FAMILIES["qwen3moe"].items() if k != "arch"}
    hf = tiny_hf_model("qwen3_moe", **{**spec, "hidden": HIDDEN, "head_dim": HIDDEN // 4,
                                                 "moe_intermediate_size": FFN})
    src = GGUFModel.open(write_gguf(hf, tmp_path / "q.gguf", "qwen3_moe", quant=qtype))
    assert src.meta.tensor("blk.0.ffn_up_exps.weight").ggml_type == T[qtype]
    ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, 40).tolist()
    logits = []
    for fmt in ("auto", "f32"):
        model = compile_paged(build_model(src.config, src.tensor, fmt), F32)
        runner = ModelRunner(model, KVCache(model.layout, src.config.num_layers, num_blocks=4))
        logits.append(runner.step([ScheduledChunk(ids, 0, [[0, 1]], num_logits=len(ids))]).logits[0].copy())
    np.testing.assert_allclose(logits[0], logits[1], rtol=0, atol=1e-4 * np.abs(logits[1]).max())


@pytest.mark.parametrize("arch, qk_norm", [("qwen3moe", "head"), ("olmoe", "full")])
def test_random_moe_models_load_as_their_family_and_run_on_gathermatmul(arch, qk_norm, smollm2_gguf, tmp_path,
                                                                       monkeypatch):
    """The bench's real-size random MoE models (here a tiny shape in their place): written as
    their family, read back with its routing, every expert product on GatherMatmul."""
    from vinoserve.bench import random_models

    shape = random_models.Shape(arch, 64, 2, 4, 2, 32, 96, 1e6, EXPERTS, 2, qk_norm)
    monkeypatch.setitem(random_models.MOE_SHAPES, "tiny", shape)
    assert f"{arch}-tiny-q4_k_m-random" in random_models.names()
    path = random_models.write(tmp_path / "m.gguf", "tiny", random_models.one_type(T.Q4_0), log=lambda m: None)
    src = GGUFModel.open(path)
    assert src.config.architecture == arch and src.config.head_size == 32
    assert src.config.experts == ExpertRouting(EXPERTS, 2, normalize=arch == "qwen3moe")
    assert src.meta.tensor("blk.1.ffn_down_exps.weight").shape == (EXPERTS, 64, 96)
    model = compile_paged(build_model(src.config, src.tensor, "auto"), F32)
    kinds = [n.get_rt_info()["layerType"].astype(str) for n in model.compiled.get_runtime_model().get_ordered_ops()]
    assert kinds.count("GatherMatmul") == 3 * 2
    runner = ModelRunner(model, KVCache(model.layout, src.config.num_layers, num_blocks=2))
    assert np.isfinite(runner.step([ScheduledChunk(list(range(40)), 0, [[0, 1]], num_logits=1)]).logits[0]).all()


def test_random_q4_k_m_gives_the_experts_down_projection_more_bits_where_llama_quantize_does():
    from vinoserve.bench import random_models

    encode, x = random_models.q4_k_m(48), np.zeros((2, 256), np.float32)
    assert encode("blk.0.ffn_down_exps.weight", x)[1] == T.Q6_K  # the first eighth
    assert encode("blk.10.ffn_down_exps.weight", x)[1] == T.Q4_K
    assert encode("blk.10.ffn_gate_exps.weight", x)[1] == T.Q4_K


@pytest.mark.parametrize("cpu,quant", [("AMX", "Q4_0"), ("AVX512_BF16", "Q4_0"), ("AVX2", "Q4_0"), ("AMX", "Q4_K")])
def test_each_cpu_classs_defaults_put_the_experts_on_the_kernel(cpu, quant, kernel, tmp_path, monkeypatch):
    """What a server compiles by default per CPU class for a mixture of experts (on every class
    one f32 compilation with the low-bit kernel, AMX's dense models' decode model not taken: one
    copy of the experts) and with the decode model asked for on AMX (bf16 prompts, the experts
    there on the plugin's GatherMatmul): every compilation runs, the experts where the startup
    log says (Q4_K's block minimums inside the kernel's products, not counted as products of
    their own), a prompt's argmax as at f32 and a decode step finite."""
    from vinoserve.model import cpu_defaults
    from vinoserve.model.compile_options import CompileOptions
    from vinoserve.model.cpu_class import CpuClass

    spec = {k: v for k, v in MOE_FAMILIES["qwen3moe"].items() if k != "arch"}
    hf = tiny_hf_model("qwen3_moe", **{**spec, "hidden": HIDDEN, "head_dim": HIDDEN // 4, "moe_intermediate_size": FFN})
    src = GGUFModel.open(write_gguf(hf, tmp_path / "q.gguf", "qwen3_moe", quant=quant))
    ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, 60).tolist()
    monkeypatch.setattr(cpu_defaults, "this_cpu", lambda: CpuClass[cpu])
    layers = src.config.num_layers
    cases = [(F32, None), (CompileOptions(), {"kernel": 3 * layers})]
    if cpu == "AMX":
        # on GatherMatmul a block minimum is a second product of its own
        cases.append((CompileOptions(decode_model=True), {"GatherMatmul": 3 * layers * (2 if quant == "Q4_K" else 1),
                                                          "decode kernel": 3 * layers}))
    logits = []
    for options, where in cases:
        model = compile_paged(build_model(src.config, src.tensor, "auto"), options)
        runner = ModelRunner(model, KVCache(model.layout, layers, num_blocks=4))
        logits.append(runner.step([ScheduledChunk(ids, 0, [[0, 1, 2]], num_logits=len(ids))]).logits[0].copy())
        if where is None:
            continue
        assert model.decode is not None  # the decode model, or the one-token clone
        kinds = [[n.get_rt_info()["layerType"].astype(str) for n in c.get_runtime_model().get_ordered_ops()]
                 for c in (model.compiled, model.decode)]
        if "kernel" in where:
            assert "; 6 expert products on vinoserve's low-bit kernel (routed experts only" in model.describe()
            assert model.main_kernel.experts == where["kernel"] and "GatherMatmul" not in kinds[0] + kinds[1]
        else:
            assert "6 expert products on the plugin's GatherMatmul (routed experts only; a prompt's one per token " \
                   "and expert), the decode model's on vinoserve's low-bit kernel" in model.describe()
            assert kinds[0].count("GatherMatmul") == where["GatherMatmul"] and "GatherMatmul" not in kinds[1]
            assert model.decode_graph.experts == where["decode kernel"]
        assert (logits[-1].argmax(-1) == logits[0].argmax(-1)).mean() >= 0.9
        step = runner.step([ScheduledChunk([int(logits[-1][-1].argmax())], len(ids), [[0, 1, 2]], num_logits=1)])
        assert np.isfinite(step.logits[0]).all()


@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe", "olmoe"])
def test_logits_after_eviction_and_rotation_equal_a_fresh_run_on_the_survivors(name, tmp_path):
    """Cache eviction re-rotates the kept keys with the family's RoPE (one layer: the survivors'
    K/V do not depend on what was evicted, so a fresh run on them is the exact reference)."""
    import torch
    from test_eviction import _engine as eviction_engine
    from test_eviction import _run as run_one

    spec = MOE_FAMILIES[name]
    hf = tiny_hf_model(spec["arch"], layers=1, **{k: v for k, v in spec.items() if k != "arch"})
    engine = eviction_engine(str(write_gguf(hf, tmp_path / "one.gguf", spec["arch"])))
    assert engine.runner.model.options.cache_rotation
    prompt = np.random.default_rng(3).integers(0, hf.config.vocab_size, 100).tolist()
    outs = run_one(engine, prompt, SamplingParams(max_tokens=2, temperature=0, logprobs=20, ignore_eos=True))
    assert engine.evictor.num_evicted_blocks == 1 and engine.evictor.num_rotated_blocks == 2
    survivors = prompt[:32] + prompt[64:] + [outs[0].new_token_ids[0]]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([survivors])).logits[0, -1].double(), -1).numpy()
    assert outs[1].new_token_ids[0] == int(ref.argmax())
    for token, lp in outs[1].new_logprobs[0][1]:
        assert abs(lp - ref[token]) < 1e-4, (token, lp, ref[token])
