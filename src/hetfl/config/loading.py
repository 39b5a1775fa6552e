"""One job: a config from YAML and overrides to a validated `RunConfig`, with errors that
name each field, the value received, what is allowed, and for an unknown key the closest
known one.

Plugins (`hetfl.core.plugins`) are imported here, at the edge, before validation: `validate`
imports the plugins a config names, so that the names they register validate; `load_raw`
makes a plugin file's relative path absolute against the config file's folder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hetfl.config.errors import problem_lines
from hetfl.config.run import RunConfig
from hetfl.config.sections import ConfigError
from hetfl.core.plugins import PluginError, is_file, load_plugins, resolve


# -- loading, overrides, errors ------------------------------------------------------------
def parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """`["train.lr=0.1", "sweep.seed=[0,1]"]` -> `{"train.lr": 0.1, ...}` (values as YAML)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override {pair!r} is not of the form key=value (e.g. train.lr=0.1)")
        key, _, raw = pair.partition("=")
        if not key:
            raise ConfigError(f"override {pair!r} has an empty key")
        try:
            out[key.strip()] = _load_yaml(raw) if raw.strip() else None
        except (DuplicateKeyError, yaml.YAMLError) as exc:
            problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
            why = (
                exc if isinstance(exc, DuplicateKeyError) else f"its value is not YAML ({problem})"
            )
            raise ConfigError(f"override {pair!r}: {why}") from None
    return out


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if not isinstance(child, dict):
            child = {}
            node[p] = child
        node = child
    node[parts[-1]] = value


def load_raw(path: str | Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        raw = _load_yaml(p.read_text()) or {}
    except DuplicateKeyError as exc:
        raise ConfigError(f"config file {str(p)!r}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping, got {type(raw).__name__}")
    plugins = raw.get("plugins")
    if isinstance(plugins, list):
        folder = p.resolve().parent
        raw["plugins"] = [
            resolve(x, folder) if isinstance(x, str) and is_file(x) else x for x in plugins
        ]
    return raw


class DuplicateKeyError(Exception):
    """A mapping in YAML that gives one key twice: YAML's loaders keep the last value
    silently, so a setting the author believes in would be ignored."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise DuplicateKeyError(
                    f"key {key!r} is given twice (lines {first_line[key]} and {line}); the "
                    "last would silently win: keep one"
                )
            first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain data only


def validate(raw: Mapping[str, Any], *, import_plugins: bool = True) -> RunConfig:
    """`raw` as a `RunConfig`, or a ConfigError naming every problem. The plugins `raw`
    names are imported first; with `import_plugins=False` (a config that arrived in a
    message, which must never make this process import code) they must be imported
    already, which the record checks."""
    if import_plugins:
        plugins = raw.get("plugins") or []
        if not isinstance(plugins, list):
            raise ConfigError(
                "plugins: a list of module names or .py files, e.g. [my_package.my_module, "
                f"./my_file.py] (got {plugins!r})"
            )
        try:
            load_plugins(plugins)
        except PluginError as exc:
            raise ConfigError(f"plugins: {exc}") from exc
    try:
        return RunConfig.model_validate(dict(raw))
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, raw)) from None


def format_errors(exc: ValidationError, raw: Mapping[str, Any]) -> str:
    lines = [f"invalid configuration ({exc.error_count()} problem(s)):"]
    lines += [f"  - {line}" for line in problem_lines(exc, raw, RunConfig)]
    return "\n".join(lines)


def default_config_path() -> Path:
    return Path(__file__).parents[1] / "configs" / "default.yaml"
