"""Writes the shipped trace fixture (`src/hetfl/systems/trace_fixture/`): 300 devices drawn
from stated distributions, so that trace-driven runs work offline. The real FedScale traces
are larger and measured; these are synthetic, of the same shape.

- computation: ms per sample of the reference model (MobileNetV2 inference,
  `hetfl.systems.traces.REFERENCE_MACS`), log-normal with median 60 ms and sigma 0.8
  (phones from a few ms to a few hundred ms per sample);
- communication: kbit/s, log-normal with median 5000 kbit/s and sigma 1.0;
- behaviour: a period (`finish_time`) of 6 h, alternating reachable and unreachable spells
  with exponential lengths of mean 30 min and 60 min, 0 s falling in a random phase
  (the alternation starts 2 h before it).

Run `python tools/make_trace_fixture.py` from the repository root; it is deterministic
(seed 52).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DEVICES = 300
SEED = 52
PERIOD_S = 6 * 3600
ACTIVE_MEAN_S, INACTIVE_MEAN_S = 1800.0, 3600.0
OUT = Path("src/hetfl/systems/trace_fixture")


def behaviour(rng: random.Random) -> dict[str, object]:
    active: list[float] = []
    inactive: list[float] = []
    # the alternation runs from 2 h before 0, so that 0 falls in a random phase of it
    t = -7200.0
    while True:
        end = t + rng.expovariate(1 / ACTIVE_MEAN_S)
        start, stop = max(0, round(t)), min(round(end), PERIOD_S)
        if start >= PERIOD_S:
            break
        if stop > start and (not inactive or start > inactive[-1]):
            active.append(start)
            inactive.append(stop)
        t = end + rng.expovariate(1 / INACTIVE_MEAN_S)
    return {"active": active, "inactive": inactive, "finish_time": PERIOD_S}


def main() -> None:
    rng = random.Random(SEED)
    OUT.mkdir(parents=True, exist_ok=True)
    rows = ["device,computation,communication"]
    behaviours = {}
    for device in range(1, DEVICES + 1):
        computation = rng.lognormvariate(mu=0, sigma=0.8) * 60
        communication = rng.lognormvariate(mu=0, sigma=1.0) * 5000
        rows.append(f"{device},{computation:.3f},{communication:.1f}")
        drawn = behaviour(rng)
        while not drawn["active"]:  # a device never reachable in 6 h is drawn again
            drawn = behaviour(rng)
        behaviours[str(device)] = drawn
    (OUT / "capacity.csv").write_text("\n".join(rows) + "\n")
    (OUT / "behaviour.json").write_text(json.dumps(behaviours, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
