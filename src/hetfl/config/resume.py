"""One job: what `hetfl resume` may change of a run, and the refusal of what it may not.

A resumed run must equal the uninterrupted one, so the config a checkpoint was written
under (stored in the checkpoint) is compared, key by key, with the run folder's
`config.yaml` before anything runs. Keys that decide where and how the work runs, or what
is written, cannot alter a metric (`NEUTRAL_KEYS`): a change to them is allowed, and they
are exactly the keys `hetfl resume DIR key=value` accepts as overrides. A change to any
other key would give a run mixed from two configs: it is refused, naming each key with its
two values and what to do instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from hetfl.config.sections import ConfigError

#: Keys (and every key under them) that cannot alter a run's metrics: where its outputs
#: go, how often it is checkpointed, where its clients run, how private state is held,
#: whether the dataset may be downloaded, which targets the summary reads, and the Flower
#: settings (which the simulator ignores). `threads` is not one: intra-op threading changes
#: the order of float sums, so results depend on it.
NEUTRAL_KEYS = (
    "name",
    "output_dir",
    "checkpoint_every",
    "executor",
    "workers",
    "ray",
    "store",
    "tracking",
    "targets",
    "data.download",
    "data.mirror",
    "deploy",
)
#: The one executor whose results differ from the others' (by about 1e-5): a change to or
#: from it alters results, any other change of executor does not.
_NOT_BIT_EXACT = "vectorised"


@dataclass(frozen=True)
class Change:
    """One dotted key whose value differs: `before` in the checkpoint's config, `after` in
    the one resumed with (`_ABSENT` where a side has no such key)."""

    key: str
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"{self.key}: {_shown(self.before)} -> {_shown(self.after)}"


_ABSENT = object()


def _shown(value: Any) -> str:
    return "(absent)" if value is _ABSENT else repr(value)


def is_neutral(key: str) -> bool:
    """Whether the dotted `key` is one of `NEUTRAL_KEYS` or lies under one."""
    return any(key == k or key.startswith(k + ".") for k in NEUTRAL_KEYS)


def changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[Change]:
    """Every dotted key whose value differs between two configs as dumped (nested
    mappings compared key by key, anything else, lists too, as a whole), sorted."""
    flat_before, flat_after = _flatten(before), _flatten(after)
    return [
        Change(k, flat_before.get(k, _ABSENT), flat_after.get(k, _ABSENT))
        for k in sorted(set(flat_before) | set(flat_after))
        if flat_before.get(k, _ABSENT) != flat_after.get(k, _ABSENT)
    ]


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def alters_results(change: Change) -> bool:
    """Whether `change` can alter a metric: any key outside `NEUTRAL_KEYS`, and a change of
    executor to or from the vectorised one."""
    if change.key == "executor":
        return _NOT_BIT_EXACT in (change.before, change.after)
    return not is_neutral(change.key)


def check_resume(written_under: str, resumed: str, run_dir: str) -> list[Change]:
    """The result-neutral changes from `written_under` (the YAML of the config the
    checkpoint was written under) to `resumed` (the YAML of the config resumed with); a
    ConfigError naming every change that would alter results, and what to do."""
    found = changes(yaml.safe_load(written_under), yaml.safe_load(resumed))
    refused = [c for c in found if alters_results(c)]
    if refused:
        listed = "; ".join(map(str, refused))
        vectorised = (
            " (executor: between any two but vectorised, which agrees to about 1e-5)"
            if any(c.key == "executor" for c in refused)
            else ""
        )
        raise ConfigError(
            f"{run_dir}: the config to resume with (its config.yaml and any overrides) differs "
            f"from the one its checkpoint was written under in what determines the results "
            f"({listed}): a resume would mix two configs. Put those values back to continue "
            f"the run, or start a new run with the edited config (`hetfl run "
            f"{run_dir}/config.yaml name=<new name>`); only {', '.join(NEUTRAL_KEYS)} may "
            f"change on resume{vectorised}"
        )
    return found


def neutral_overrides(overrides: Mapping[str, Any]) -> None:
    """A ConfigError unless every `hetfl resume` override is a result-neutral key."""
    refused = [k for k in overrides if not is_neutral(k)]
    if refused:
        raise ConfigError(
            f"hetfl resume: cannot override {', '.join(refused)}: a resumed run must equal "
            "the uninterrupted one, so resume overrides only keys that cannot alter results "
            f"({', '.join(NEUTRAL_KEYS)}); start a new run to change "
            f"{'it' if len(refused) == 1 else 'them'} (`hetfl run CONFIG key=value`)"
        )


def resume_record(
    after_round: int, overrides: Mapping[str, Any], edited: Sequence[Change]
) -> dict[str, Any]:
    """`summary.json`'s `resumed`: the round the run was resumed after, the overrides
    given, and the result-neutral keys of config.yaml changed since the checkpoint."""
    return {
        "after_round": after_round,
        "overrides": dict(overrides),
        "changed": {c.key: None if c.after is _ABSENT else c.after for c in edited},
    }
