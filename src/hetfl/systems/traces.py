"""Device and behaviour traces: measured phones instead of a handful of synthetic profiles.

FedScale ("FedScale: Benchmarking Model and System Performance of Federated Learning at
Scale", §3.2 and its docs' "Device Trace File Formats") ships two Python pickles:

- `client_device_capacity`: device id -> {'computation': ms per sample, 'communication':
  kbit/s}, from AI Benchmark (compute) and MobiPerf (bandwidth);
- `client_behave_trace`: device id -> {'active': [s, ...], 'inactive': [s, ...],
  'finish_time': s, 'duration': s, 'model': str}: the moments a phone became reachable
  and unreachable over a week, repeated with period `finish_time`.

A pickle can run arbitrary code when loaded, so `load_pickle` accepts only the opcodes of
plain containers, strings and numbers: any global (a class, a function, numpy's scalars)
is refused before it is built. HetFL's own formats hold the same fields: a capacity CSV
with the columns `device,computation,communication`, and JSON files with the pickles'
structure (`hetfl.systems` ships a fixture of each, `trace_fixture/`).

FedScale prices a sample's compute by the device alone, whatever the model. HetFL prices
a client's own sub-model: a device's `computation` is read as its time for one sample of
a reference model, so its rate is `reference_macs / computation` MAC/s, and a client's
compute time is its counted training MACs over that rate. The reference is MobileNetV2
(1.0, 224 x 224) inference, 300 M multiply-adds a sample ("MobileNetV2: Inverted Residuals
and Linear Bottlenecks", Table 4): AI Benchmark's per-sample times are mobile vision
inference and MobileNetV2 is the network the phones of that benchmark run. A training
sample costs about three forward passes in HetFL's count, as FedScale's own factor of 3
for training says (`augmentation_factor`). The bandwidth is taken for both directions,
as FedScale does.
"""

from __future__ import annotations

import csv
import io
import json
import math
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

#: MACs of one sample of the reference model: MobileNetV2 (1.0, 224) inference.
REFERENCE_MACS = 3.0e8
#: The name that selects the shipped fixture instead of a path.
FIXTURE = "fixture"


@dataclass(frozen=True)
class DeviceCapacity:
    """One measured device: `computation` ms per reference sample, `communication` kbit/s."""

    device: int
    computation: float
    communication: float

    def __post_init__(self) -> None:
        for name in ("computation", "communication"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"device {self.device}: {name} must be positive, got {value!r}")

    def rate(self, reference_macs: float) -> float:
        """MAC/s: the reference model's MACs per sample over the device's time for one."""
        return reference_macs / (self.computation / 1000)

    @property
    def mbps(self) -> float:
        return self.communication / 1000


@dataclass(frozen=True)
class Behaviour:
    """When one device is reachable: from each `active[i]` until `inactive[i]` (seconds),
    repeating every `finish_time` seconds (FedScale's `ClientSim.is_active`)."""

    active: tuple[float, ...]
    inactive: tuple[float, ...]
    finish_time: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.finish_time) and self.finish_time > 0):
            raise ValueError(f"finish_time must be positive, got {self.finish_time!r}")
        if len(self.active) != len(self.inactive) or not self.active:
            raise ValueError(
                f"a behaviour needs as many active as inactive moments, at least one "
                f"(got {len(self.active)} and {len(self.inactive)})"
            )
        bounds = [b for pair in zip(self.active, self.inactive, strict=True) for b in pair]
        if any(b < 0 for b in bounds) or bounds != sorted(bounds) or bounds[-1] > self.finish_time:
            raise ValueError(
                "active/inactive moments must alternate in increasing order within "
                f"[0, finish_time={self.finish_time:g}]"
            )

    def available_until(self, t: float) -> float | None:
        """The moment (on the simulated clock) the device stops being reachable, if it is
        reachable at `t`; else None."""
        period = math.floor(t / self.finish_time) * self.finish_time
        local = t - period
        for start, end in zip(self.active, self.inactive, strict=True):
            if start <= local < end:
                if end < self.finish_time or self.active[0] > 0:
                    return period + end
                # the spell runs on into the next period's first one
                return math.inf if len(self.active) == 1 else period + end + self.inactive[0]
        return None

    def available(self, t: float) -> bool:
        return self.available_until(t) is not None

    def next_available(self, t: float) -> float:
        """The first moment at or after `t` at which the device is reachable."""
        if self.available(t):
            return t
        period = math.floor(t / self.finish_time) * self.finish_time
        later = [start for start in self.active if start > t - period]
        return period + (later[0] if later else self.finish_time + self.active[0])


class _PlainUnpickler(pickle.Unpickler):
    """Builds plain containers, strings and numbers only: every global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"refused {module}.{name}: a trace pickle may hold only dicts, lists, tuples, "
            "strings and numbers"
        )


def load_pickle(data: bytes) -> Any:
    """A pickle's plain content (dicts, lists, tuples, str, int, float, bool, None)."""
    return _PlainUnpickler(io.BytesIO(data)).load()


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where} must be a number, got {value!r}")
    return float(value)


def _entries(raw: Any, what: str) -> dict[int, Mapping[str, Any]]:
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError(f"a {what} trace must map device ids to records, got {type(raw).__name__}")
    out = {}
    for key, record in raw.items():
        try:
            device = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"{what} trace: device id {key!r} is not an integer") from None
        if not isinstance(record, Mapping):
            raise ValueError(f"{what} trace: device {device}'s record is not a mapping")
        out[device] = record
    return dict(sorted(out.items()))


def parse_capacities(raw: Any) -> dict[int, DeviceCapacity]:
    """Device id -> capacity, from FedScale's structure (a pickle's or JSON's content)."""
    out = {}
    for device, record in _entries(raw, "capacity").items():
        values = [
            _number(record.get(k), f"device {device}: {k}")
            for k in ("computation", "communication")
        ]
        out[device] = DeviceCapacity(device, *values)
    return out


def parse_behaviours(raw: Any) -> dict[int, Behaviour]:
    """Device id -> behaviour, from FedScale's structure (extra keys such as 'model' and
    'duration' are ignored)."""
    out = {}
    for device, record in _entries(raw, "behaviour").items():
        where = f"device {device}"
        lists = []
        for k in ("active", "inactive"):
            values = record.get(k)
            if not isinstance(values, list | tuple):
                raise ValueError(f"{where}: {k} must be a list of seconds, got {values!r}")
            lists.append(tuple(_number(v, f"{where}: {k}") for v in values))
        finish = _number(record.get("finish_time"), f"{where}: finish_time")
        try:
            out[device] = Behaviour(lists[0], lists[1], finish)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return out


def _read(path: str, fixture_file: str) -> tuple[str, bytes]:
    """(suffix, bytes) of a trace file, or of the shipped fixture's `fixture_file`."""
    if path == FIXTURE:
        data = resources.files("hetfl.systems").joinpath("trace_fixture", fixture_file)
        return Path(fixture_file).suffix, data.read_bytes()
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"trace file {path!r} not found")
    return file.suffix, file.read_bytes()


def _structure(suffix: str, data: bytes, path: str) -> Any:
    if suffix == ".json":
        return json.loads(data)
    if suffix in ("", ".pkl", ".pickle"):  # FedScale's files have no suffix
        return load_pickle(data)
    raise ValueError(f"trace file {path!r}: unknown format {suffix!r} (.csv, .json, .pkl)")


def load_capacities(path: str) -> dict[int, DeviceCapacity]:
    """A capacity trace: FedScale's pickle, its structure in JSON, or a CSV with the columns
    `device,computation,communication`; `fixture` for the shipped one."""
    suffix, data = _read(path, "capacity.csv")
    if suffix == ".csv":
        rows = list(csv.DictReader(io.StringIO(data.decode())))
        missing = {"device", "computation", "communication"} - set(rows[0] if rows else {})
        if missing:
            raise ValueError(f"capacity CSV {path!r} lacks the columns {sorted(missing)}")
        raw: Any = {
            r["device"]: {
                "computation": float(r["computation"]),
                "communication": float(r["communication"]),
            }
            for r in rows
        }
    else:
        raw = _structure(suffix, data, path)
    return parse_capacities(raw)


def load_behaviours(path: str) -> dict[int, Behaviour]:
    """A behaviour trace: FedScale's pickle or its structure in JSON; `fixture` for the
    shipped one."""
    suffix, data = _read(path, "behaviour.json")
    return parse_behaviours(_structure(suffix, data, path))
