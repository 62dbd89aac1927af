"""Run anything (the suite, a benchmark, a server) as it would go on another CPU class, on this
machine: a check that a change keeps the suite and the built-in model's answers on classes the
session has no machine of. Not a measurement of speed: the kernels run on this CPU.

    PYTHONPATH=$PWD/benchmarks/emulate_cpu_class VINOSERVE_EMULATE_CLASS=AVX-512 \
        ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI python -m pytest -q       # Cascade / Ice Lake
    PYTHONPATH=$PWD/benchmarks/emulate_cpu_class VINOSERVE_EMULATE_CLASS=AVX-512-SKX \
        ONEDNN_MAX_CPU_ISA=AVX512_CORE python -m pytest -q            # Skylake-SP (no VNNI)
    PYTHONPATH=$PWD/benchmarks/emulate_cpu_class VINOSERVE_EMULATE_CLASS=AVX2 \
        ONEDNN_MAX_CPU_ISA=AVX2 python -m pytest -q                   # Zen 2 / 3, Haswell to Skylake client

ONEDNN_MAX_CPU_ISA caps the plugin's kernels; the plugin's own choices read CPUID instead, so here
they are made as that class's CPUs make them: f32 compute whatever the hint (no bf16 or f16
arithmetic there), and on AVX2 no int8 activations (no VNNI on Zen 2 / 3; Alder Lake's AVX-VNNI is
not emulated; the AVX-512 class has VNNI). openvino-genai's pipelines compile in C++, past
ov.Core, so its ContinuousBatchingPipeline is given the same settings (`vinoserve bench engine`).
vinoserve sees the class's flags (cpu_class.cpu_flags), so its defaults and its kernel's path
(model/lowbit/build.py) follow the class. Python imports this module at start-up from
PYTHONPATH; a child process keeps it where it inherits the environment.
"""
import os

_CLASS = os.environ.get("VINOSERVE_EMULATE_CLASS")
_FLAGS = {
    "AVX2": {"sse4_2", "avx", "avx2", "fma", "f16c"},
    "AVX-512": {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl",
                "avx512_vnni"},
    # Skylake-SP: the AVX-512 class without VNNI (the kernel's avx512bw path; cap oneDNN at AVX512_CORE)
    "AVX-512-SKX": {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"},
}

if _CLASS:
    import openvino as ov

    from vinoserve.model import cpu_class

    if _CLASS not in _FLAGS:
        raise SystemExit(f"VINOSERVE_EMULATE_CLASS={_CLASS!r}: one of {', '.join(_FLAGS)}")
    _cpu_flags, _compile, _get_property = cpu_class.cpu_flags, ov.Core.compile_model, ov.Core.get_property

    def _flags(cpuinfo=None):
        return frozenset(_FLAGS[_CLASS]) if cpuinfo is None else _cpu_flags(cpuinfo)

    def _compile_model(self, model, device_name=None, config=None, **kwargs):
        if device_name in (None, "CPU"):
            config = _class_config(config)
        return _compile(self, model, device_name, config, **kwargs)

    def _class_config(config: dict | None) -> dict:
        config = dict(config or {})
        config["INFERENCE_PRECISION_HINT"] = "f32"
        if _CLASS in ("AVX2", "AVX-512-SKX"):  # no VNNI: no int8 activations of the plugin's
            config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = "0"
        return config

    def _property(self, *args):
        if len(args) == 2 and args[0] == "CPU" and args[1] == "INFERENCE_PRECISION_HINT":
            return ov.Type.f32
        return _get_property(self, *args)

    cpu_class.cpu_flags = _flags
    cpu_class.this_cpu.cache_clear()
    ov.Core.compile_model = _compile_model
    ov.Core.get_property = _property

    try:  # openvino-genai compiles in C++, past ov.Core: its pipeline gets the class's settings here
        import openvino_genai as _genai
    except ImportError:
        _genai = None
    if _genai is not None:
        _pipeline = _genai.ContinuousBatchingPipeline

        def _continuous_batching(models_path, scheduler_config, device="CPU", properties=None, **kwargs):
            properties = _class_config(properties) if device == "CPU" else properties
            return _pipeline(models_path, scheduler_config, device, properties or {}, **kwargs)

        _genai.ContinuousBatchingPipeline = _continuous_batching
