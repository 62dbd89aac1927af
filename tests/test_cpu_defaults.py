"""CPU-dependent defaults (model/cpu_defaults.py): each CPU class gets the compilation measured
best on it, and whatever the user asks for wins over the table."""
from __future__ import annotations

import pytest

from gguf_fixtures import tiny_hf_model, write_gguf
from vinoserve.model import cpu_defaults
from vinoserve.model.cpu_class import CpuClass, classify, cpu_flags
from vinoserve.model.cpu_defaults import resolve
from vinoserve.model.gguf_loader import GGUFModel
from vinoserve.model.graph import build_model
from vinoserve.model.compile_options import CompileOptions


class _Core:
    """Answers the plugin's default compute precision as the CPU class would."""

    def __init__(self, precision: str) -> None:
        self.precision = precision

    def get_property(self, device: str, name: str):
        assert (device, name) == ("CPU", "INFERENCE_PRECISION_HINT")
        return type("T", (), {"get_type_name": lambda _: self.precision})()


@pytest.fixture(scope="module")
def q4_0(tmp_path_factory):
    src = GGUFModel.open(write_gguf(tiny_hf_model("llama"), tmp_path_factory.mktemp("cpu") / "q4_0.gguf", quant="Q4_0"))
    return build_model(src.config, src.tensor, "auto")


@pytest.fixture(scope="module")
def f16(tmp_path_factory):
    src = GGUFModel.open(write_gguf(tiny_hf_model("llama"), tmp_path_factory.mktemp("cpu") / "f16.gguf"))
    return build_model(src.config, src.tensor, "auto")


@pytest.mark.parametrize("flags,expected", [
    ("fpu sse avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8", CpuClass.AMX),
    ("fpu avx2 avx512f avx512_vnni avx512_bf16", CpuClass.AVX512_BF16),  # Zen 4
    ("fpu avx2 avx512f avx512_vnni", CpuClass.AVX512),  # Ice Lake
    ("fpu avx avx2 fma", CpuClass.AVX2),  # Zen 3
    ("fpu sse4_2", CpuClass.OTHER),
])
def test_classes_from_cpuinfo_flags(tmp_path, flags, expected):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert classify(cpu_flags(info)) is expected
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_each_class_gets_its_measured_defaults(q4_0):
    amx = resolve(CompileOptions(), _Core("bf16"), q4_0, CpuClass.AMX)
    assert (amx.decode_model, amx.kv_cache_precision, amx.dynamic_quantization_group_size) == (True, "u8", None)
    assert amx.properties().get("DYNAMIC_QUANTIZATION_GROUP_SIZE") is None
    zen = resolve(CompileOptions(), _Core("bf16"), q4_0, CpuClass.AVX512_BF16)  # one f32 compilation on the kernel
    assert (zen.lowbit_main, zen.inference_precision, zen.kv_cache_precision) == (True, "f32", "f16")
    assert not zen.decode_model
    assert zen.properties()["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == "0"  # nothing low-bit is left to the plugin
    assert not amx.lowbit_main
    zen4 = resolve(CompileOptions(lowbit_kernel=False), _Core("bf16"), q4_0, CpuClass.AVX512_BF16)
    assert (zen4.decode_model, zen4.kv_cache_precision, zen4.dynamic_quantization_group_size) == (False, "bf16", 0)
    assert zen4.properties()["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == "0" and not zen4.lowbit_main
    for cpu in (CpuClass.AVX512, CpuClass.AVX2):  # the kernel's AVX-512 or AVX2 path, one f32 compilation
        kernel = resolve(CompileOptions(), _Core("f32"), q4_0, cpu)
        assert (kernel.lowbit_main, kernel.inference_precision, kernel.kv_cache_precision) == (True, "f32", "f16")
        assert kernel.lowbit_coarse == "all_but_qkv"  # a prompt's rows: two planes in q/k/v only
        plain = resolve(CompileOptions(lowbit_kernel=False), _Core("f32"), q4_0, cpu)  # the plugin's choices
        assert (plain.decode_model, plain.kv_cache_precision, plain.dynamic_quantization_group_size) == (False, None, None)
        assert "DYNAMIC_QUANTIZATION_GROUP_SIZE" not in plain.properties() and not plain.lowbit_main
    assert all(o.fuse_projections for o in (amx, zen, zen4))
    assert (amx.lowbit_prefetch, zen.lowbit_prefetch) == (1024, 4096)  # the kernel's, by class
    assert zen.lowbit_coarse == "gate_up"


def test_without_low_bit_weights_the_kernel_has_nothing_to_take(f16):
    plain = resolve(CompileOptions(), _Core("bf16"), f16, CpuClass.AVX512_BF16)
    assert (plain.lowbit_main, plain.inference_precision, plain.kv_cache_precision) == (False, None, "bf16")


def test_what_the_user_asks_for_wins(q4_0):
    core = _Core("bf16")
    asked = resolve(CompileOptions(dynamic_quantization_group_size=32, kv_cache_precision="u8"), core, q4_0,
                    CpuClass.AVX512_BF16)
    assert asked.properties()["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == "32" and asked.kv_cache_precision == "u8"
    assert resolve(CompileOptions(decode_model=True), core, q4_0, CpuClass.AVX512_BF16).decode_model
    for precision in ("bf16", "f32"):  # f32 asked for is f32 arithmetic, not the kernel's int8
        assert not resolve(CompileOptions(inference_precision=precision), core, q4_0, CpuClass.AVX512_BF16).lowbit_main
    bf16_cache = resolve(CompileOptions(kv_cache_precision="bf16"), core, q4_0, CpuClass.AVX512_BF16)
    assert not bf16_cache.lowbit_main and bf16_cache.inference_precision is None  # f32 compute refuses a bf16 cache
    u8 = resolve(CompileOptions(kv_cache_precision="u8"), core, q4_0, CpuClass.AVX512_BF16)
    assert u8.lowbit_main and u8.kv_cache_precision == "u8"
    off = resolve(CompileOptions(decode_model=False), core, q4_0, CpuClass.AMX)
    assert not off.decode_model and off.kv_cache_precision == "bf16"
    f32 = resolve(CompileOptions(inference_precision="f32"), core, q4_0, CpuClass.AMX)
    assert not f32.decode_model and f32.properties()["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == "0"


def test_the_table_covers_every_class():
    assert set(cpu_defaults.DEFAULTS) == set(CpuClass)


def test_the_flag_reaches_the_compile_options():
    from vinoserve.cli import _engine_config, build_parser

    args = build_parser().parse_args(["serve", "--dynamic-quantization-group-size", "32"])
    assert _engine_config(args).compile.dynamic_quantization_group_size == 32
    assert _engine_config(build_parser().parse_args(["serve"])).compile.dynamic_quantization_group_size is None
