"""Trace-driven devices: FedScale's pickles (loaded without running code), HetFL's CSV and
JSON, the shipped fixture, behaviours on the simulated clock, and a client's compute time
priced from its own MACs at its device's rate per reference-model MAC."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from hetfl.core.spec import Spec
from hetfl.systems.clock import Clock, Usage
from hetfl.systems.profiles import ProfileSchedule, SystemConfig
from hetfl.systems.traces import (
    REFERENCE_MACS,
    Behaviour,
    load_behaviours,
    load_capacities,
    load_pickle,
)

#: FedScale's documented formats (its docs' "Device Trace File Formats").
CAPACITY = {
    7: {"computation": 100.0, "communication": 8000.0},
    9: {"computation": 25.0, "communication": 2000.0},
    12: {"computation": 300.0, "communication": 500.0},
}
BEHAVIOUR = {
    7: {"duration": 50, "inactive": [20, 90], "finish_time": 100, "active": [0, 50], "model": "x"},
    9: {"duration": 100, "inactive": [100], "finish_time": 100, "active": [0], "model": "y"},
}


def write(path, obj) -> str:
    path.write_bytes(pickle.dumps(obj))
    return str(path)


class Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_fedscale_pickles_load_as_rates_per_reference_mac_and_kbit(tmp_path):
    caps = load_capacities(write(tmp_path / "client_device_capacity", CAPACITY))
    assert sorted(caps) == [7, 9, 12]
    # 100 ms per sample of 300 M MACs: 3 GMAC/s; 8000 kbit/s = 8 Mbit/s
    assert caps[7].rate(REFERENCE_MACS) == pytest.approx(3e9)
    assert caps[7].mbps == 8.0
    behaviours = load_behaviours(write(tmp_path / "client_behave_trace", BEHAVIOUR))
    assert behaviours[7] == Behaviour((0.0, 50.0), (20.0, 90.0), 100.0)


ODD = {1: {"computation": 1.0, "communication": 1.0, "x": complex(1, 2)}}  # a global


@pytest.mark.parametrize("payload", [Boom(), {1: Boom()}, ODD])
def test_a_pickle_holding_anything_but_plain_containers_and_numbers_is_refused(tmp_path, payload):
    path = write(tmp_path / "evil.pkl", payload)
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        load_capacities(path)
    assert load_pickle(pickle.dumps({1: [1.5, (2, "a")], "k": None})) == {
        1: [1.5, (2, "a")],
        "k": None,
    }


def test_hetfl_csv_and_json_formats_and_their_errors(tmp_path):
    csv = tmp_path / "caps.csv"
    csv.write_text("device,computation,communication\n3,50,1000\n1,10,4000\n")
    caps = load_capacities(str(csv))
    assert sorted(caps) == [1, 3] and caps[3].rate(1e8) == pytest.approx(2e9)
    js = tmp_path / "caps.json"
    js.write_text(json.dumps({str(k): v for k, v in CAPACITY.items()}))
    assert load_capacities(str(js)) == load_capacities(write(tmp_path / "c.pkl", CAPACITY))
    csv.write_text("device,computation\n1,10\n")
    with pytest.raises(ValueError, match=r"lacks the columns \['communication'\]"):
        load_capacities(str(csv))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"1": {"computation": -1, "communication": 5}}))
    with pytest.raises(ValueError, match="device 1: computation must be positive"):
        load_capacities(str(bad))
    bad.write_text(json.dumps({"1": {"active": [5, 1], "inactive": [6, 2], "finish_time": 9}}))
    with pytest.raises(ValueError, match="device 1: active/inactive moments must alternate"):
        load_behaviours(str(bad))
    with pytest.raises(ValueError, match="not found"):
        load_capacities(str(tmp_path / "missing.csv"))
    with pytest.raises(ValueError, match=r"unknown format '\.txt'"):
        (tmp_path / "t.txt").write_text("x")
        load_capacities(str(tmp_path / "t.txt"))


def test_a_behaviour_repeats_every_finish_time_and_says_when_a_device_leaves():
    b = Behaviour((0.0, 50.0), (20.0, 90.0), 100.0)
    assert [b.available(t) for t in (0, 19.9, 20, 49, 50, 89, 90, 100, 155)] == [
        True, True, False, False, True, True, False, True, True,
    ]  # fmt: skip
    assert b.available_until(10) == 20 and b.available_until(160) == 190
    assert b.available_until(30) is None
    assert [b.next_available(t) for t in (10, 30, 95, 120)] == [10, 50, 100, 150]
    assert Behaviour((10.0,), (20.0,), 100.0).next_available(25) == 110
    # a spell up to finish_time goes on into the next period's spell from 0
    assert Behaviour((0.0, 50.0), (20.0, 100.0), 100.0).available_until(60) == 120
    assert Behaviour((0.0,), (100.0,), 100.0).available_until(5) == float("inf")


def test_the_shipped_fixture_has_300_devices_with_behaviours():
    cfg = SystemConfig(trace={"capacity": "fixture", "behaviour": "fixture"})
    settings = cfg.settings()
    assert settings is not None and len(settings.profiles) == 300
    assert settings.behaviours is not None and len(settings.behaviours) == 300


def test_clients_take_devices_by_a_seeded_permutation_and_their_own_macs_price_compute(
    tmp_path,
):
    cfg = SystemConfig(
        trace={
            "capacity": write(tmp_path / "cap", CAPACITY),
            "behaviour": write(tmp_path / "beh", BEHAVIOUR),
        }
    )
    settings = cfg.settings()
    assert settings is not None
    # device 12 has no behaviour: left out
    assert [p.name for p in settings.profiles] == ["device-7", "device-9"]
    placed = ProfileSchedule(settings, 3, range(4)).at(1)
    names = [placed[c].name for c in range(4)]
    assert sorted(names[:2]) == ["device-7", "device-9"] and names[2:] == names[:2]  # cycles
    assert names == [p.name for p in ProfileSchedule(settings, 3, range(4)).at(1).values()]
    # a sub-model of 6e8 training MACs on device 7 (3 GMAC/s): 0.2 s; 1 MB up at 8 Mbit/s: 1 s
    device7 = next(p for p in settings.profiles if p.name == "device-7")
    times = Clock(settings).client_times(1, Spec(model="m"), device7, Usage(6 * 10**8, 0, 10**6))
    assert times.compute_s == pytest.approx(0.2) and times.up_s == pytest.approx(1.0)


def test_a_trace_excludes_presets_and_placements():
    with pytest.raises(ValueError, match="give one of preset, profiles or trace"):
        SystemConfig(preset="dtfl", trace={"capacity": "fixture"})
    with pytest.raises(ValueError, match="places clients on devices itself"):
        SystemConfig(trace={"capacity": "fixture"}, fractions=[1.0])
