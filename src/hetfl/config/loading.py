"""One job: a config from YAML and overrides to a validated `RunConfig`, with errors that
name each field, the value received, what is allowed, and for an unknown key the closest
known one.

Plugins (`hetfl.core.plugins`) are imported here, at the edge, before validation: `validate`
imports the plugins a config names, so that the names they register validate; `load_raw`
makes a plugin file's relative path absolute against the config file's folder.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

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
        out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
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
        raw = yaml.safe_load(p.read_text()) or {}
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
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        field = ".".join(loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"  - {field}: unknown key{_suggestion(loc)}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        got = _lookup(raw, loc)
        shown = "" if got is _MISSING else f" (got {got!r})"
        lines.append(f"  - {field}: {msg}{shown}")
    return "\n".join(lines)


_MISSING = object()


def _lookup(raw: Any, loc: Sequence[str]) -> Any:
    node = raw
    for p in loc:
        if isinstance(node, Mapping) and p in node:
            node = node[p]
        elif isinstance(node, list) and p.isdigit() and int(p) < len(node):
            node = node[int(p)]
        else:
            return _MISSING
    return node


def _suggestion(loc: Sequence[str]) -> str:
    """'; did you mean X?' from the fields of the model that holds the unknown key."""
    model: type[BaseModel] = RunConfig
    for p in loc[:-1]:
        field = model.model_fields.get(p)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(loc[-1], allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} (allowed: {', '.join(allowed)})"


def default_config_path() -> Path:
    return Path(__file__).parents[1] / "configs" / "default.yaml"
