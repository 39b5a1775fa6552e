"""The compute scale of a config's device profiles at which SplitFed's simulated time to a
target is DTFL's Table 3 multiple of FedAvg's (2.73x: 35,877 s against 13,157 s, CIFAR-10
IID, ResNet-56; "Speed up Federated Learning in Heterogeneous Environment: A Dynamic
Tiering Approach", §4.2), priced from the cost model without training
(`hetfl.systems.calibration`).

The config is built twice, as `algorithm: splitfed` and as `algorithm: fedavg` (the data,
the model and the profiles as it sets them); every client's round 1 is planned and priced
(training MACs, server-side MACs, payload, upload and per-batch channel bytes: what the
engine charges), and rounds 1..R are timed with the config's own profile schedule (its
switches drawn from the seed). SplitFed learns as FedAvg does, so both reach a target in
the same round R, and their time to it is the sum of those rounds. Every compute rate
(clients' and server's) is multiplied by one scale c, the links kept; the tool prints c,
the `system.fastest_rate` and `system.server_rate` it gives, the ratio at c for each R,
and the ratio with every link multiplied by `--link-factor` (the authors' code reads its
100/30/30/30/10 as MB/s of 1024^2 bytes: 8.388608 x the Mbit/s), at c.

Usage: python tools/calibrate_profiles.py CONFIG [key=value ...] [--target 2.73]
       [--rounds R] [--link-factor 8.388608] [--json OUT]
Every client must take part in every round (`train.clients_per_round` = the clients), as in
DTFL's Table 3.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hetfl.assembly import build_parts
from hetfl.config import ConfigError, RunConfig, load_raw, parse_overrides, set_dotted, validate
from hetfl.core.rng import SERVER, torch_generator
from hetfl.engine.rounds import setup_strategy
from hetfl.models.resnet_cifar import split_family
from hetfl.systems.calibration import RoundCost, priced_round, solve_scale, time_to
from hetfl.systems.costs import MacCounter
from hetfl.systems.profiles import DeviceProfile, ProfileSchedule, SystemSettings

#: SplitFed's time to the target over FedAvg's, DTFL Table 3 (CIFAR-10 IID, ResNet-56).
PAPER_RATIO = 35877 / 13157
#: The authors' code's links: the profile numbers taken as MB/s (1024^2 bytes) per Mbit/s.
MBYTES = 1024**2 * 8 / 1e6


def as_method(cfg: RunConfig, algorithm: str) -> RunConfig:
    """`cfg` run as `algorithm` (no sweep, no targets: nothing is run)."""
    raw = cfg.model_dump(mode="json", exclude_unset=True)
    raw.update(algorithm=algorithm, sweep=None)
    return validate(raw)


def priced(cfg: RunConfig) -> tuple[dict[int, RoundCost], SystemSettings]:
    """Each client's priced round under `cfg`'s algorithm (fedavg or splitfed), and the
    system its profiles come from."""
    parts = build_parts(cfg, show_progress=False)
    system = parts.settings.system
    if system is None:
        raise ConfigError("the calibration prices device profiles: the config needs a system:")
    infos = [c.info() for c in parts.clients]
    if cfg.train.clients_per_round != len(infos):
        raise ConfigError(
            f"train.clients_per_round = {cfg.train.clients_per_round} of {len(infos)} clients: "
            "the calibration prices full participation (DTFL's Table 3)"
        )
    strategy = parts.strategy
    state = setup_strategy(strategy, infos, parts.settings)
    tasks = strategy.plan(1, state, infos, torch_generator(cfg.seed, 1, SERVER, "sample"))
    family = strategy.family
    counter = MacCounter(family)
    data = {c.cid: c for c in parts.clients}
    out = {}
    for task in tasks:
        client = data[task.cid]
        shape = tuple(client.x_train.shape[1:])
        server = None
        if cfg.algorithm == "splitfed":
            server = split_family(family, "splitfed").server_spec(task.spec)
        elif cfg.algorithm != "fedavg":
            raise ConfigError(f"the calibration prices fedavg and splitfed, not {cfg.algorithm}")
        out[task.cid] = priced_round(
            counter, task, client.n_train, shape, server, answers=server is not None
        )
    return out, system


def schedule(system: SystemSettings, seed: int, cids: Sequence[int], rounds: int, links: float):
    """Each round's client -> profile, every link multiplied by `links`."""
    at = ProfileSchedule(system, seed, cids)
    scaled = {
        p.name: replace(p, down_mbps=p.down_mbps * links, up_mbps=p.up_mbps * links)
        for p in system.profiles
    }
    return [{cid: scaled[p.name] for cid, p in at.at(r).items()} for r in range(1, rounds + 1)]


def calibrate(cfg: RunConfig, target: float, rounds: int, link_factor: float) -> dict[str, Any]:
    """The scale, the rates it gives, and the ratios (a JSON-able record)."""
    split, system = priced(as_method(cfg, "splitfed"))
    whole, _ = priced(as_method(cfg, "fedavg"))
    cids = sorted(whole)

    def ratio(scale: float, upto: int = rounds, links: float = 1.0) -> float:
        at: list[Mapping[int, DeviceProfile]] = schedule(system, cfg.seed, cids, upto, links)
        return time_to(split, at, system.server_rate, scale) / time_to(
            whole, at, system.server_rate, scale
        )

    scale = solve_scale(ratio, target)
    at = schedule(system, cfg.seed, cids, rounds, 1.0)
    return {
        "target": target,
        "rounds": rounds,
        "scale": scale,
        "fastest_rate": cfg.system.fastest_rate * scale,
        "server_rate": cfg.system.server_rate * scale,
        "ratio_by_rounds": {r: ratio(scale, r) for r in range(1, rounds + 1)},
        "fedavg_s": time_to(whole, at, system.server_rate, scale),
        "splitfed_s": time_to(split, at, system.server_rate, scale),
        "link_factor": link_factor,
        "ratio_at_link_factor": ratio(scale, rounds, link_factor),
        "ratio_at_scale_1": ratio(1.0),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--target", type=float, default=PAPER_RATIO)
    parser.add_argument("--rounds", type=int, default=None, help="default: train.rounds")
    parser.add_argument("--link-factor", type=float, default=MBYTES)
    parser.add_argument("--json", type=Path, default=None, help="also write the record here")
    args = parser.parse_args(argv)
    raw = load_raw(args.config)
    raw.pop("sweep", None)
    for key, value in parse_overrides(args.overrides).items():
        set_dotted(raw, key, value)
    cfg = validate(raw)
    rounds = args.rounds or cfg.train.rounds
    record = calibrate(cfg, args.target, rounds, args.link_factor)
    print(
        f"scale {record['scale']:.4g}: system.fastest_rate {record['fastest_rate']:.4g}, "
        f"system.server_rate {record['server_rate']:.4g} (MAC/s)"
    )
    print(
        f"SplitFed / FedAvg over {rounds} rounds: {record['ratio_by_rounds'][rounds]:.4f} "
        f"(target {args.target:.4f}; {record['splitfed_s']:.1f} s against "
        f"{record['fedavg_s']:.1f} s); at scale 1: {record['ratio_at_scale_1']:.4f}"
    )
    ratios = ", ".join(f"{r}: {v:.3f}" for r, v in record["ratio_by_rounds"].items())
    print(f"by rounds to target: {ratios}")
    print(
        f"links x {args.link_factor:g} at this scale: SplitFed / FedAvg "
        f"{record['ratio_at_link_factor']:.4f}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
