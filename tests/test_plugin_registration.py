"""Plugin registration: the built-in plugin once, plugins passed in code first, and third-party plugins discovered
through the `pagedcore` entry-point group of an installed distribution (tiny random-weight Llama, CPU)."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from pagedcore import builtin_plugins
from pagedcore.attention.torch_backend import TorchAttentionBackend
from pagedcore.plugins import make_plugin_manager
from plugin_helpers import PROMPTS, RecordingPlugin, greedy, make_llm, model_dir, run_engine  # noqa: F401


# ---- registration ------------------------------------------------------------------------------
def count_builtin(pm) -> int:
    return sum(1 for p in pm.get_plugins() if p is builtin_plugins)


def test_builtin_registered_exactly_once():
    pm = make_plugin_manager()
    assert count_builtin(pm) == 1
    assert pm.get_plugin("builtin") is builtin_plugins
    # One implementation per hook: the project's own "builtin" entry point did not add a second.
    for hook in ("pagedcore_load_model", "pagedcore_attention_backend", "pagedcore_scheduling_policy"):
        impls = getattr(pm.hook, hook).get_hookimpls()
        assert [i.plugin for i in impls] == [builtin_plugins], hook


def test_plugins_passed_in_code_are_called_before_builtin():
    plugin = RecordingPlugin()
    pm = make_plugin_manager([plugin])
    assert pm.is_registered(plugin) and count_builtin(pm) == 1
    # firstresult: the plugin's answer wins; its None defers to the built-in.
    assert pm.hook.pagedcore_scheduling_policy(name="lifo").name == "lifo"
    assert pm.hook.pagedcore_scheduling_policy(name="fcfs").name == "fcfs"
    assert pm.hook.pagedcore_scheduling_policy(name="nope") is None
    assert plugin.policy_calls == ["lifo", "fcfs", "nope"]
    assert pm.hook.pagedcore_attention_backend(name=None, device=torch.device("cpu")) is plugin.backend
    assert isinstance(pm.hook.pagedcore_attention_backend(name="torch", device=torch.device("cpu")),
                      TorchAttentionBackend)


THIRDPARTY_SRC = textwrap.dedent('''
    from pagedcore import hookimpl
    from pagedcore.attention.torch_backend import TorchAttentionBackend

    STEPS = []
    EVENTS = []

    class ThirdBackend(TorchAttentionBackend):
        name = "thirdparty"
        calls = 0

        def forward(self, *args, **kwargs):
            type(self).calls += 1
            return super().forward(*args, **kwargs)

    @hookimpl
    def pagedcore_attention_backend(name, device):
        return ThirdBackend() if name == "thirdparty" else None

    @hookimpl
    def pagedcore_step_end(stats):
        STEPS.append(stats)

    @hookimpl
    def pagedcore_request_event(event, request_id, seq_index, info):
        EVENTS.append((event, request_id))
''')


@pytest.fixture
def thirdparty_dist(tmp_path, monkeypatch):
    """An 'installed' third-party distribution: a module plus a dist-info with an entry point."""
    root = tmp_path / "site"
    root.mkdir()
    (root / "thirdparty_plugin.py").write_text(THIRDPARTY_SRC)
    info = root / "thirdparty_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty_plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pagedcore]\nthird = thirdparty_plugin\n")
    monkeypatch.syspath_prepend(str(root))
    yield root
    sys.modules.pop("thirdparty_plugin", None)


def test_entry_point_plugin_is_discovered(thirdparty_dist, model_dir):
    pm = make_plugin_manager()
    third = pm.get_plugin("third")
    assert third is not None, f"entry-point plugin not registered: {pm.list_name_plugin()}"
    assert third.__name__ == "thirdparty_plugin"
    assert count_builtin(pm) == 1
    dists = {d.project_name for _, d in pm.list_plugin_distinfo()}
    assert "thirdparty_plugin" in dists
    # An engine built with no plugins in code uses it: its backend (selected by name) and its hooks.
    llm = make_llm(model_dir, attention_backend="thirdparty")
    assert llm.engine.pm.get_plugin("third") is third
    assert type(llm.engine.runner.backend).__name__ == "ThirdBackend"
    third.STEPS.clear(), third.EVENTS.clear()
    steps, final = run_engine(llm.engine, PROMPTS[:2], greedy(3))
    assert steps == 3 and len(final) == 2
    assert len(third.STEPS) == steps
    assert third.ThirdBackend.calls == steps * llm.engine.runner.shape.num_layers
    assert sorted(rid for ev, rid in third.EVENTS if ev == "finished") == ["0", "1"]


def test_entry_point_plugin_absent_without_dist():
    pm = make_plugin_manager()
    assert pm.get_plugin("third") is None
    assert [name for name, _ in pm.list_name_plugin()] == ["builtin"]
