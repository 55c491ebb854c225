"""The BentoML front door's settings, no server needed: `pagedcore serve-bentoml` execs `bentoml serve`
with the engine settings in PAGEDCORE_* variables, which the service parses back."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("bentoml")

from servers import SERVICE  # noqa: E402

pytestmark = pytest.mark.slow  # as the rest of the door's tests (test_bentoml_service.py)


def test_serve_bentoml_subcommand_execs_bentoml_serve_with_engine_settings_in_env(monkeypatch):
    from pagedcore import cli

    seen = {}
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: seen.update(argv=argv, env=env))
    monkeypatch.delenv("PAGEDCORE_DTYPE", raising=False)
    cli.main(["serve-bentoml", "--host", "127.0.0.1", "--port", "3123", "--dtype", "float32", "--max-num-seqs", "8"])
    assert seen["argv"][1:] == ["-m", "bentoml", "serve", SERVICE, "--host", "127.0.0.1", "--port", "3123"]
    assert seen["env"]["PAGEDCORE_DTYPE"] == "float32" and seen["env"]["PAGEDCORE_MAX_NUM_SEQS"] == "8"
    assert "PAGEDCORE_BLOCK_SIZE" not in seen["env"]  # defaults stay unset: the environment decides


def test_engine_settings_from_env_parse_every_config_type():
    from pagedcore.adapters.bentoml_service import engine_settings_from_env

    env = {"PAGEDCORE_MODEL": "/models/x", "PAGEDCORE_NUM_KV_BLOCKS": "64", "PAGEDCORE_KV_CACHE_FRACTION": "0.5",
           "PAGEDCORE_ENABLE_CHUNKED_PREFILL": "false", "PAGEDCORE_MAX_MODEL_LEN": "none", "PAGEDCORE_DTYPE": "",
           "PAGEDCORE_SERVED_MODEL_NAME": "ignored-here"}
    assert engine_settings_from_env(env) == {"model": "/models/x", "num_kv_blocks": 64, "kv_cache_fraction": 0.5,
                                             "enable_chunked_prefill": False, "max_model_len": None}
    with pytest.raises(ValueError, match="PAGEDCORE_MAX_NUM_SEQS"):
        engine_settings_from_env({"PAGEDCORE_MAX_NUM_SEQS": "many"})
