"""What `hetfl list` prints: every registered name with its one-line summary, read from the
torch-free `hetfl.catalogue` for HetFL's own entries, or from the registries themselves once
plugins are imported (`hetfl list --plugin MODULE`: torch is imported then), with what each
plugin registered. Both list HetFL's own entries, the attacks among them (`hetfl.attacks`
registers them when imported), beside the plugins'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hetfl import catalogue
from hetfl.core.registry import Registry


@dataclass(frozen=True)
class Listing:
    """The registries' names (and summaries where they have one); `plugins`: each loaded
    plugin with the entries it registered, as "<kind> <name>"."""

    algorithms: Mapping[str, str]
    models: Sequence[str]
    architectures: Mapping[str, str]
    composed: Mapping[str, str]
    split: Mapping[str, str]
    datasets: Sequence[str]
    partitioners: Sequence[str]
    reducers: Mapping[str, str]
    wrappers: Mapping[str, str]
    attacks: Mapping[str, str]
    plugins: Mapping[str, Sequence[str]] = field(default_factory=dict)
    #: The detection sets a detector trains on (`data.dataset`; no plugin adds one).
    detection_datasets: Sequence[str] = catalogue.DETECTION_DATASETS


def built_in() -> Listing:
    """HetFL's own entries, without importing torch."""
    return Listing(
        catalogue.ALGORITHMS,
        catalogue.MODELS,
        catalogue.ARCHITECTURES,
        catalogue.COMPOSED,
        catalogue.SPLIT,
        catalogue.DATASETS,
        catalogue.PARTITIONERS,
        catalogue.REDUCERS,
        catalogue.WRAPPERS,
        catalogue.ATTACKS,
    )


def with_plugins(plugins: Sequence[str]) -> Listing:
    """Every entry after importing `plugins` (`hetfl.core.plugins.load_plugins`, whose
    PluginError names a plugin that fails), read from the registries."""
    import hetfl.attacks  # noqa: F401 (registers the built-in attacks)
    from hetfl.algorithms import ALGORITHMS
    from hetfl.attacks.registry import ATTACKS
    from hetfl.core.client.wrappers import WRAPPERS
    from hetfl.core.plugins import load_plugins
    from hetfl.core.server.reducers import REDUCERS
    from hetfl.data import DATASETS, PARTITIONERS
    from hetfl.models import ARCHITECTURES, COMPOSED, MODELS, SPLIT

    loaded = load_plugins(plugins)
    summarised = (ALGORITHMS, ARCHITECTURES, COMPOSED, SPLIT, REDUCERS, WRAPPERS, ATTACKS)
    algorithms, architectures, composed, split, reducers, wrappers, attacks = (
        {n: r.get(n).summary for n in r} for r in summarised
    )
    registries: list[Registry[Any]] = [*summarised, MODELS, DATASETS, PARTITIONERS]
    own = {
        plugin: [f"{r.kind} {n}" for r in registries for n in r if r.origin(n) == plugin]
        for plugin in loaded
    }
    return Listing(
        algorithms,
        MODELS.names(),
        architectures,
        composed,
        split,
        DATASETS.names(),
        PARTITIONERS.names(),
        reducers,
        wrappers,
        attacks,
        own,
    )


def lines(listing: Listing) -> list[str]:
    out = ["algorithms:", *_summaries(listing.algorithms)]
    out.append(f"models: {', '.join(sorted(listing.models))}")
    out.append("scalable models (model.width, stages, blocks, bn, stem):")
    out += _summaries(listing.architectures)
    out.append("composed models (model.compose, basis):")
    out += _summaries(listing.composed)
    out.append("split models, in modules for split learning (model.blocks):")
    out += _summaries(listing.split)
    out.append(f"datasets: {', '.join(sorted(listing.datasets))}")
    out.append(f"detection datasets: {', '.join(sorted(listing.detection_datasets))}")
    out.append(f"partitioners: {', '.join(sorted(listing.partitioners))}")
    out.append("reducers (options.<method>.reducer: {kind: ..., ...}):")
    out += _summaries(listing.reducers)
    none = "" if listing.wrappers else " none"
    out.append(f"client-program wrappers (wrappers: [{{kind: ..., ...}}]):{none}")
    out += _summaries(listing.wrappers)
    out.append("attacks (attack: {kind: ..., fraction: ..., ...}):")
    out += _summaries(listing.attacks)
    for plugin, entries in listing.plugins.items():
        out.append(f"plugin {plugin}: {', '.join(entries) or 'registers nothing'}")
    return out


def _summaries(entries: Mapping[str, str]) -> list[str]:
    return [f"  {name:<12} {summary}" for name, summary in sorted(entries.items())]
