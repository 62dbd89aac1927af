"""Which sampling defaults are in force: the model's (generation_config.json, GGUF metadata, a
built-in model's recommendation), none, or a directory's; overrides on top; bad values refused."""
from __future__ import annotations

import json

import gguf
import pytest

from vinoserve.cli import build_parser
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.generation_config import load_generation_defaults

QWEN_LIKE = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
             "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
             "transformers_version": "4.37.0"}


def _ir_dir(tmp_path, config: dict):
    d = tmp_path / "exported"
    d.mkdir(parents=True)
    (d / "generation_config.json").write_text(json.dumps(config))
    return d


def test_builtin_model_uses_its_recommended_values():
    for model in (None, "smollm2-135m-instruct"):
        defaults = load_generation_defaults("auto", model)
        assert defaults.values() == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 256}
        assert "recommended" in defaults.describe()


def test_ir_directory_generation_config_sampling_fields_only(tmp_path):
    d = _ir_dir(tmp_path, {**QWEN_LIKE, "max_new_tokens": 300})
    assert load_generation_defaults("auto", str(d)).values() == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 300}
    # No generation_config.json, or one with token ids only: nothing to apply.
    assert load_generation_defaults("auto", str(tmp_path)).values() == {}
    assert load_generation_defaults("auto", str(_ir_dir(tmp_path / "x", {"eos_token_id": 2}))).values() == {}


def test_vinoserve_mode_ignores_the_model_and_overrides_still_apply(tmp_path):
    d = _ir_dir(tmp_path, QWEN_LIKE)
    assert load_generation_defaults("vinoserve", str(d)).values() == {}
    assert load_generation_defaults("vinoserve", None).describe() == "none (OpenAI's)"
    got = load_generation_defaults("auto", None, {"temperature": 0, "max_new_tokens": 64, "do_sample": False})
    assert got.values() == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 64}
    assert got.source == "smollm2-135m-instruct recommended + --override-generation-config"


def test_a_directory_as_the_mode_reads_its_generation_config(tmp_path):
    d = _ir_dir(tmp_path, {"temperature": 0.3})
    assert load_generation_defaults(str(d), None).values() == {"temperature": 0.3}
    with pytest.raises(ModelLoadError, match="auto, vinoserve, or a directory"):
        load_generation_defaults(str(tmp_path / "missing"), None)


@pytest.mark.parametrize("bad", [{"temperature": "hot"}, {"top_k": 2.5}, {"top_p": True}, {"max_new_tokens": 1e400}])
def test_bad_values_are_load_errors_naming_the_file(tmp_path, bad):
    d = _ir_dir(tmp_path, bad)
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        load_generation_defaults("auto", str(d))


def test_gguf_sampling_metadata(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_float32("general.sampling.temp", 0.6)
    w.add_float32("general.sampling.top_p", 0.95)
    w.add_int32("general.sampling.top_k", 40)
    w.add_float32("general.sampling.penalty_repeat", 1.1)  # last-N semantics: not applied
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = load_generation_defaults("auto", str(path)).values()
    assert got == {"temperature": pytest.approx(0.6), "top_p": pytest.approx(0.95), "top_k": 40}


def test_cli_flags_and_environment(monkeypatch):
    args = build_parser().parse_args(["serve", "--generation-config", "vinoserve",
                                      "--override-generation-config", '{"max_new_tokens": 512}'])
    assert (args.generation_config, args.override_generation_config) == ("vinoserve", {"max_new_tokens": 512})
    monkeypatch.setenv("VINOSERVE_OVERRIDE_GENERATION_CONFIG", '{"top_k": 5}')
    assert build_parser().parse_args(["serve"]).override_generation_config == {"top_k": 5}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--override-generation-config", "[1]"])
