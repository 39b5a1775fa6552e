"""Plugins: a user's modules, imported before a config is validated, so that what they
register (algorithms, models, datasets, partitioners, reducers, client-program wrappers) is
known to HetFL's registries without a fork of HetFL.

A plugin is named in one of two ways:

- a module name, `my_package.my_module`: imported from `sys.path` like any module (an
  installed package, or a folder on `PYTHONPATH`);
- the path of a Python file, `./my_file.py` (a name ending in `.py` or holding a `/`):
  imported from that file under the module name `hetfl_plugin_<stem>`, the same in every
  process, so that objects it defines pickle between a run's processes and a Flower node
  can tell that it loaded the plugin a server's config names. A relative path is resolved
  against a folder the caller gives (the config file's, `hetfl.config.load_raw`) or else the
  current directory; the resolved config records the absolute path.

`load_plugins` is the one way in: each plugin is imported once per process (loading one
already imported does nothing), inside `registering_for(plugin)`, so that a name it
registers that HetFL (or another plugin) already has is refused naming both. A plugin that
cannot be found or fails to import raises `PluginError`, naming the plugin and the error.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from hetfl.core.registry import registering_for

#: The module-name prefix of a plugin imported from a file.
FILE_MODULE_PREFIX = "hetfl_plugin_"
_WHERE = (
    "a path in a config file is relative to that file's folder, on the command line to the "
    "current directory"
)


class PluginError(ValueError):
    """A plugin that cannot be loaded; the message names it and says why."""


def is_file(plugin: str) -> bool:
    """Whether `plugin` names a file (ends in `.py` or holds a path separator) rather than a
    module."""
    return plugin.endswith(".py") or "/" in plugin or "\\" in plugin


def resolve(plugin: str, base: Path | None = None) -> str:
    """`plugin` as a config records it: a module name as it is (checked), a file's path made
    absolute against `base` (default: the current directory)."""
    if not isinstance(plugin, str) or not plugin.strip():
        raise PluginError(
            f"a plugin is a module name (my_package.my_module) or a .py file's path; got {plugin!r}"
        )
    if is_file(plugin):
        return str(((base or Path.cwd()) / Path(plugin).expanduser()).resolve())
    if not all(part.isidentifier() for part in plugin.split(".")):
        raise PluginError(
            f"plugin {plugin!r} is neither a module name (dotted identifiers, "
            "my_package.my_module) nor a .py file's path (./my_file.py)"
        )
    return plugin


def module_name(plugin: str) -> str:
    """The name `plugin`'s module has in `sys.modules` once loaded: a module's own name, or
    `hetfl_plugin_<stem>` for a file (its stem with every other character than a letter, a
    digit or `_` made `_`)."""
    if not is_file(plugin):
        return plugin
    return FILE_MODULE_PREFIX + re.sub(r"\W", "_", Path(plugin).stem)


def is_loaded(plugin: str) -> bool:
    """Whether a module of `plugin`'s name is imported in this process (for a file: any file
    of the same name)."""
    return module_name(plugin) in sys.modules


def load_plugins(plugins: Iterable[str]) -> list[str]:
    """Imports each plugin not imported yet, in order (a relative path against the current
    directory); returns them resolved (`resolve`). PluginError names the plugin that cannot
    be found or fails to import (a name it registers twice included), with the error."""
    resolved = [resolve(p) for p in plugins]
    for plugin in resolved:
        _load(plugin)
    return resolved


def _load(plugin: str) -> None:
    name = module_name(plugin)
    loaded = sys.modules.get(name)
    if loaded is not None:
        if is_file(plugin) and loaded.__file__ != plugin:
            raise PluginError(
                f"plugin {plugin!r}: another file of the same name, {loaded.__file__!r}, is "
                f"loaded as module {name!r}; rename one of them"
            )
        return
    if is_file(plugin) and not Path(plugin).is_file():
        raise PluginError(f"plugin {plugin!r}: no such file ({_WHERE})")
    with registering_for(plugin):
        try:
            _import(plugin, name)
        except Exception as exc:
            hint = ""
            missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
            if missing and (plugin == missing or plugin.startswith(missing + ".")):
                hint = (
                    " (a module name is imported from sys.path: install its package, add its "
                    "folder to PYTHONPATH, or name the file, ./path/to/module.py)"
                )
            raise PluginError(
                f"plugin {plugin!r} failed to import: {type(exc).__name__}: {exc}{hint}"
            ) from exc


def _import(plugin: str, name: str) -> None:
    if not is_file(plugin):
        importlib.import_module(plugin)
        return
    spec = importlib.util.spec_from_file_location(name, plugin)
    if spec is None or spec.loader is None:
        raise ImportError("not a Python source file (.py)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: pickle finds its classes by this name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
