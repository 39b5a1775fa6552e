"""One job: a config's `sweep:` grid expanded into named points, each a raw config."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from typing import Any

from hetfl.config.loading import set_dotted, validate
from hetfl.config.run import RunConfig
from hetfl.config.sections import ConfigError


# -- sweeps --------------------------------------------------------------------------------
def expand_sweep(raw: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """One (point name, raw config) per combination of the `sweep:` values.

    Keys are `algorithm`, `seed` or any dotted key; names read `<algorithm>-s<seed>` plus
    `-<key>=<value>` for every other swept key. A key that lists several dotted keys
    separated by commas sets each value into all of them (one sweep dimension): a server
    step tuned for two methods whose options live under their own names.
    """
    sweep = raw.get("sweep") or {}
    if not isinstance(sweep, Mapping):
        raise ConfigError("sweep: must map keys to lists of values, e.g. {algorithm: [fedavg]}")
    base = copy.deepcopy(dict(raw))
    base.pop("sweep", None)
    if not sweep:
        return [(_point_name(base, {}), base)]
    keys = list(sweep)
    for k in keys:
        values = sweep[k]
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.{k}: needs a non-empty list of values (got {values!r})")
    points = []
    for combo in itertools.product(*(sweep[k] for k in keys)):
        point = copy.deepcopy(base)
        for k, v in zip(keys, combo, strict=True):
            for target in _tied_keys(k):
                set_dotted(point, target, v)
        extra = {k: v for k, v in zip(keys, combo, strict=True) if k not in ("algorithm", "seed")}
        points.append((_point_name(point, extra), point))
    names = [n for n, _ in points]
    if len(set(names)) != len(names):
        raise ConfigError("sweep: two points get the same name; sweep distinct values")
    return points


def validate_points(raw: Mapping[str, Any]) -> list[tuple[str, RunConfig]]:
    """Every point of `raw` (one without a sweep) validated; a point's errors are named as
    that sweep point's, with its index and name, since its values are not in the file as
    written."""
    points = expand_sweep(raw)
    if not raw.get("sweep"):
        return [(name, validate(point)) for name, point in points]
    checked = []
    for i, (name, point) in enumerate(points, start=1):
        try:
            checked.append((name, validate(point)))
        except ConfigError as exc:
            raise ConfigError(f"sweep point {i} of {len(points)} ({name}): {exc}") from None
    return checked


def _tied_keys(key: str) -> list[str]:
    """The dotted keys a sweep key sets: itself, or each of a comma-separated list."""
    keys = [k.strip() for k in key.split(",")]
    if not all(keys):
        raise ConfigError(
            f"sweep.{key}: an empty key in a comma-separated list; write the dotted keys that "
            "take the same value, e.g. 'options.fedadagrad.server_lr, options.fedyogi.server_lr'"
        )
    return keys


def _point_name(point: Mapping[str, Any], extra: Mapping[str, Any]) -> str:
    name = f"{point.get('algorithm', 'fedavg')}-s{point.get('seed', 0)}"
    for k, v in extra.items():
        name += f"-{_tied_keys(k)[0].split('.')[-1]}={v}"
    return name.replace("/", "_")
