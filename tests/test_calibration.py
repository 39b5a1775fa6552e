"""Calibrating the device profiles (`hetfl.systems.calibration`, tools/calibrate_profiles.py):
the clock's formula and the solved scale by hand, the priced rounds equal to what the
engine charges and clocks in a real run of FedAvg and SplitFed, and the tool's scale
meeting its target."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hetfl.config import validate
from hetfl.runner import run_one
from hetfl.systems.calibration import RoundCost, client_seconds, solve_scale, time_to
from hetfl.systems.profiles import DeviceProfile, SystemConfig

TOOL = Path(__file__).resolve().parents[1] / "tools" / "calibrate_profiles.py"
SLOW = DeviceProfile("slow", 1.0, 0.008, 0.004)  # 1 MAC/s; 1000 B/s down, 500 B/s up


def test_a_clients_seconds_follow_the_clock_by_hand():
    cost = RoundCost(macs=30, server_macs=200, bytes_down=1000, bytes_up=1000)
    # 1 s down + 2 s up + 30 s compute + 200 / 100 s server, in series
    assert client_seconds(cost, SLOW, 100.0) == pytest.approx(1 + 2 + 30 + 2)
    parallel = RoundCost(30, 200, 1000, 1000, parallel=True)
    assert client_seconds(parallel, SLOW, 100.0) == pytest.approx(1 + 2 + 30)
    # scale 10: compute 3 s, server 0.2 s; transfers unchanged
    assert client_seconds(cost, SLOW, 100.0, scale=10) == pytest.approx(3 + 3.2)
    # two rounds, the slowest client each
    fast = DeviceProfile("fast", 10.0, 8.0, 8.0)
    costs = {0: RoundCost(30), 1: RoundCost(100)}
    rounds = [{0: SLOW, 1: fast}, {0: fast, 1: SLOW}]
    assert time_to(costs, rounds, 1.0) == pytest.approx(max(30, 10) + max(3, 100))


def test_the_scale_solves_the_ratio_by_hand():
    # FedAvg: 1000 MACs, no transfer; SplitFed: 100 MACs and 1 s on the wire. At scale c
    # the ratio is (100 / c + 1) / (1000 / c) = 0.1 + c / 1000: 2.73 at c = 2630
    whole, split = {0: RoundCost(1000)}, {0: RoundCost(100, 0, 0, 500)}
    at = [{0: SLOW}]

    def ratio(c):
        return time_to(split, at, 1.0, c) / time_to(whole, at, 1.0, c)

    assert ratio(2630.0) == pytest.approx(2.73)
    assert solve_scale(ratio, 2.73) == pytest.approx(2630.0, rel=1e-5)
    with pytest.raises(ValueError, match=r"never reaches 50 for scales"):
        solve_scale(ratio, 50.0)


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("calibrate_profiles", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


CONFIG = {
    "name": "t",
    "algorithm": "fedavg",
    "data": {
        "dataset": "digits",
        "num_clients": 3,
        "train_samples": 150,
        "partition": {"kind": "dirichlet", "alpha": 0.5},
        "test_per_client": 0,
    },
    "model": {"name": "resnet-cifar", "blocks": 1},
    "train": {"rounds": 2, "clients_per_round": 3, "batch_size": 16, "lr": 0.01},
    "eval": {"local_eval": "none", "test_samples": 20},
    "system": {
        "preset": "dtfl",
        "fastest_rate": 1e8,
        "server_rate": 1e9,
        "switch_every": 1,
        "switch_fraction": 0.5,
    },
    "checkpoint_every": 2,
    "device": "cpu",
    "threads": 1,
}


@pytest.mark.parametrize("algorithm", ["fedavg", "splitfed"])
def test_priced_rounds_are_what_the_engine_charges_and_clocks(tool, tmp_path, algorithm):
    cfg = validate(CONFIG | {"algorithm": algorithm})
    run_one(cfg, tmp_path, show_progress=False)
    costs, system = tool.priced(cfg)
    rows = [json.loads(line) for line in (tmp_path / "clients.jsonl").read_text().splitlines()]
    sizes = {r["samples"] for r in rows}
    assert len(sizes) > 1  # unequal Dirichlet sizes, each priced as its own
    profiles = tool.schedule(system, cfg.seed, sorted(costs), 2, 1.0)
    for row in rows:
        cost = costs[row["cid"]]
        assert (row["macs"], row["bytes_down"], row["bytes_up"]) == (
            cost.macs,
            cost.bytes_down,
            cost.bytes_up,
        )
        at = profiles[row["round"] - 1][row["cid"]]
        assert row["sim"]["profile"] == at.name
        assert client_seconds(cost, at, system.server_rate) == pytest.approx(
            row["sim"]["total_s"], rel=1e-12
        )
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert time_to(costs, profiles, system.server_rate) == pytest.approx(
        metrics[-1]["sim_time_s"], rel=1e-12
    )


def test_the_tools_scale_meets_its_target(tool):
    # on 8 x 8 digits SplitFed's activations are small: its ratio spans 0.19..1.03
    record = tool.calibrate(validate(CONFIG), 0.8, 2, tool.MBYTES)
    assert record["ratio_by_rounds"][2] == pytest.approx(0.8, rel=1e-5)
    assert record["splitfed_s"] / record["fedavg_s"] == pytest.approx(0.8, rel=1e-5)
    assert record["fastest_rate"] == pytest.approx(1e8 * record["scale"])
    # the authors' MB/s links move less time onto the wire: SplitFed gains on FedAvg
    assert record["ratio_at_link_factor"] < 0.8
    with pytest.raises(ValueError, match=r"never reaches 2\.73"):
        tool.calibrate(validate(CONFIG), 2.73, 2, tool.MBYTES)


def test_link_scale_multiplies_every_link_and_is_what_the_tool_prices(tool):
    plain = SystemConfig(preset="dtfl").settings()
    scaled = SystemConfig(preset="dtfl", link_scale=tool.MBYTES).settings()
    assert plain is not None and scaled is not None
    assert [p.up_mbps for p in scaled.profiles] == pytest.approx(
        [m * 1024**2 * 8 / 1e6 for m in (100, 30, 30, 30, 10)]
    )
    assert [p.rate for p in scaled.profiles] == [p.rate for p in plain.profiles]
    with pytest.raises(ValueError, match="link_scale set without device profiles"):
        SystemConfig(link_scale=2.0)
    # the tool's ratio with its link factor is the ratio of the config with that link scale
    record = tool.calibrate(validate(CONFIG), 0.8, 2, tool.MBYTES)
    system = CONFIG["system"] | {
        "link_scale": tool.MBYTES,
        "fastest_rate": record["fastest_rate"],
        "server_rate": record["server_rate"],
    }
    again = tool.calibrate(validate(CONFIG | {"system": system}), 0.5, 2, 1.0)
    assert again["ratio_at_scale_1"] == pytest.approx(record["ratio_at_link_factor"], rel=1e-9)
