"""The plugin manager: built-ins first, then entry-point plugins, then ones passed in code."""

from __future__ import annotations

import pluggy

from pagedcore import builtin_plugins, hookspecs


def make_plugin_manager(extra_plugins=()) -> pluggy.PluginManager:
    pm = pluggy.PluginManager("pagedcore")
    pm.add_hookspecs(hookspecs)
    pm.register(builtin_plugins, name="builtin")
    # Skips our own "builtin" entry point (registered just above); anything else is a third party's.
    pm.load_setuptools_entrypoints("pagedcore")
    for plugin in extra_plugins:
        pm.register(plugin)
    return pm
