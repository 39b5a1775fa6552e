"""The simulated clock: each client's time in a round, the round's time, and deadlines.

A client's round, under its device profile (`hetfl.systems.profiles`):

    down_s    = bytes received * 8 / downlink        (payload, and gradients in split learning)
    up_s      = bytes sent * 8 / uplink              (result, and activations + labels)
    compute_s = training MACs / profile rate
    server_s  = its server program's MACs / server rate   (0 without a server program)
    total_s   = down_s + up_s + max(compute_s, server_s)  if the server program runs in
                                                          parallel (DTFL, Eq. 5)
              = down_s + up_s + compute_s + server_s      otherwise (SplitFed waits)

With behaviour traces (`hetfl.systems.traces`), a client whose device becomes unreachable
before `start + total_s` is lost for the round (`lost_problem`): it counts in `failed`, and
the round does not wait for it.

The round takes as long as its slowest participant, but the server never waits past the
deadline: clients whose `total_s` exceeds it are dropped (they count in `failed`) and the
round then takes exactly the deadline. A strategy's server phase (FedGKT's server
training, `hetfl.core.server.phase`) starts after that and adds its MACs at the server
rate (`phase_s`). Every client's server side runs at the full server
rate (the server is taken to serve its clients in parallel).

In the `measured` clock, `compute_s` and `server_s` are measured wall times of this
machine multiplied by the profile's slowdown `cpu_rate / rate` (and `cpu_rate /
server_rate`): closer to real kernels, but not reproducible, so such runs are excluded
from resume equality. Transfers are priced from bytes in both clocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hetfl.core.spec import Spec
from hetfl.core.types import ClientTimes, Problem
from hetfl.systems.profiles import DeviceProfile, SystemSettings


@dataclass(frozen=True)
class Usage:
    """What one client consumed in one round, as the engine counted and measured it.

    `wall_s` is the measured time of its local training, server side included;
    `server_wall_s` the part of it spent in its server session.
    """

    macs: int
    bytes_down: int
    bytes_up: int
    server_macs: int = 0
    parallel: bool = False
    wall_s: float = 0.0
    server_wall_s: float = 0.0


def transfer_s(nbytes: int, mbps: float) -> float:
    """Seconds to move `nbytes` over a link of `mbps` megabits (10^6 bits) per second."""
    return nbytes * 8 / (mbps * 1e6)


class Clock:
    """Prices a round's usage into simulated seconds under the run's system settings."""

    def __init__(self, settings: SystemSettings) -> None:
        self.settings = settings

    def client_times(
        self, rnd: int, spec: Spec, profile: DeviceProfile, usage: Usage
    ) -> ClientTimes:
        s = self.settings
        if s.clock == "measured":
            compute_s = max(usage.wall_s - usage.server_wall_s, 0.0) * s.cpu_rate / profile.rate
            server_s = usage.server_wall_s * s.cpu_rate / s.server_rate
        else:
            compute_s = usage.macs / profile.rate
            server_s = usage.server_macs / s.server_rate
        down_s = transfer_s(usage.bytes_down, profile.down_mbps)
        up_s = transfer_s(usage.bytes_up, profile.up_mbps)
        sides = max(compute_s, server_s) if usage.parallel else compute_s + server_s
        return ClientTimes(
            round=rnd,
            spec=spec,
            profile=profile.name,
            compute_s=compute_s,
            server_s=server_s,
            down_s=down_s,
            up_s=up_s,
            total_s=down_s + up_s + sides,
            parallel=usage.parallel,
            macs=usage.macs,
            server_macs=usage.server_macs,
            bytes_down=usage.bytes_down,
            bytes_up=usage.bytes_up,
            down_mbps=profile.down_mbps,
            up_mbps=profile.up_mbps,
        )

    def deadline_problem(self, times: ClientTimes) -> Problem | None:
        """Why the client is dropped if it finished after the deadline, else None."""
        deadline = self.settings.deadline_s
        if deadline is None or times.total_s <= deadline:
            return None
        return Problem("deadline", f"missed the deadline: {times.total_s:.4g} s > {deadline:g} s")

    def lost_problem(self, times: ClientTimes, start_s: float) -> Problem | None:
        """Why the client is lost for the round if its device's behaviour trace makes it
        unreachable before it finishes (the round started at `start_s`), else None."""
        behaviours = self.settings.behaviours
        if behaviours is None:
            return None
        until = behaviours[times.profile].available_until(start_s)
        if until is not None and start_s + times.total_s <= until:
            return None
        left = start_s if until is None else until
        return Problem(
            "lost",
            f"unreachable from {left:.6g} s, before finishing at {start_s + times.total_s:.6g} s",
        )

    def phase_s(self, macs: int, wall_s: float = 0.0) -> float:
        """Seconds of a round's server phase (`hetfl.core.server.phase`), which starts once
        every client has finished: its MACs at the server rate (measured clock: its wall
        time scaled by `cpu_rate / server_rate`)."""
        s = self.settings
        if s.clock == "measured":
            return wall_s * s.cpu_rate / s.server_rate
        return macs / s.server_rate

    def round_time(self, times: Iterable[ClientTimes]) -> float:
        """The slowest participant's time, capped at the deadline (0 for an empty round)."""
        slowest = max((t.total_s for t in times), default=0.0)
        deadline = self.settings.deadline_s
        return slowest if deadline is None else min(slowest, deadline)
