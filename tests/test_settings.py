"""One source of engine settings: CLI flags, PAGEDCORE_* variables and Triton keys all come from
EngineConfig's fields (pagedcore/settings.py)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedcore import cli, settings
from pagedcore.config import EngineConfig

FIELDS = [f.name for f in dataclasses.fields(EngineConfig)]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    settings.add_engine_arguments(p)
    return p


def test_every_field_is_a_flag_with_its_comment_as_help():
    p = _parser()
    flags = {a.dest: a for a in p._actions if a.dest in FIELDS}
    assert sorted(flags) == sorted(FIELDS)
    helps = settings.field_help()
    assert "bundled SmolLM2" in helps["model"]
    assert "torch.compile" in helps["compile"] and "on for CUDA" in helps["compile"]  # comment lines above
    for name, action in flags.items():
        assert helps.get(name, "") in action.help
        assert f"[{dataclasses.fields(EngineConfig)[FIELDS.index(name)].default}]" in action.help


def test_flags_parse_by_field_type_and_only_given_flags_reach_the_engine():
    args = _parser().parse_args(["--max-num-seqs", "8", "--kv-cache-fraction", "0.5", "--no-enable-prefix-caching",
                                 "--compile", "--max-model-len", "none", "--dtype", "bfloat16"])
    assert settings.settings_from_args(args) == {"max_num_seqs": 8, "kv_cache_fraction": 0.5,
                                                 "enable_prefix_caching": False, "compile": True, "dtype": "bfloat16"}
    assert settings.settings_from_args(_parser().parse_args([])) == {}
    EngineConfig(**settings.settings_from_args(args))  # valid keyword arguments


def test_bad_values_name_the_flag_or_variable():
    with pytest.raises(SystemExit):
        _parser().parse_args(["--max-num-seqs", "many"])
    with pytest.raises(ValueError, match="PAGEDCORE_BLOCK_SIZE='x' is not a valid int"):
        settings.settings_from_env({"PAGEDCORE_BLOCK_SIZE": "x"})
    with pytest.raises(ValueError, match="unknown engine setting 'max_seqs'"):
        settings.parse_setting("max_seqs", "4")


def test_env_and_cli_agree():
    env = {f"PAGEDCORE_{k.upper()}": v for k, v in
           {"max_num_seqs": "8", "enable_chunked_prefill": "false", "quantization": "int4"}.items()}
    args = _parser().parse_args(["--max-num-seqs", "8", "--no-enable-chunked-prefill", "--quantization", "int4"])
    assert settings.settings_from_env(env) == settings.settings_from_args(args)


@pytest.mark.parametrize("command", ["generate", "serve-bentoml", "serve-triton"])
def test_each_front_door_command_takes_every_engine_flag(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    for name in FIELDS:
        assert "--" + name.replace("_", "-") in out


def test_a_dict_field_is_a_json_object_on_the_command_line_and_in_the_environment():
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    args = _parser().parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert settings.settings_from_args(args) == {"speculative_config": spec}
    assert settings.settings_from_env({"PAGEDCORE_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 3}'}) \
        == {"speculative_config": spec}
    with pytest.raises(ValueError, match="PAGEDCORE_SPECULATIVE_CONFIG='ngram' is not a valid JSON object"):
        settings.settings_from_env({"PAGEDCORE_SPECULATIVE_CONFIG": "ngram"})
    with pytest.raises(ValueError, match="is not a valid JSON object"):
        settings.parse_setting("speculative_config", "[1, 2]")
    EngineConfig(**settings.settings_from_args(args))
