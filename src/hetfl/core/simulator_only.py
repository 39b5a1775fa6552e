"""Why a method runs in the simulator only, and its refusal by every other engine.

A registered method declares it (`Algorithm.simulator_only`, `hetfl.algorithms`); a
strategy built outside the registry shows it by its parts (a server program, a set-up
query). The engines (`hetfl.deploy`) and the face (`hetfl serve`) refuse such a method here,
before anything starts, without importing a method.
"""

from __future__ import annotations


class SimulatorOnlyError(ValueError):
    """A method that only the simulator can run (`Algorithm.simulator_only`)."""


#: Why a strategy with a server program, built outside the registry, cannot run elsewhere.
NEEDS_SERVER_PROGRAM = (
    "it needs a server program (split learning: a per-batch exchange with the server) or a "
    "round-level server phase"
)


def needs_setup_query(instead: str) -> str:
    """Why a strategy with a set-up query (`Capabilities.setup_query`) runs in the simulator
    only, with what to configure `instead`."""
    return (
        "its set-up asks each client a question about its own data, which the Flower "
        f"adapter cannot send its nodes yet; {instead}"
    )


def refuse_simulator_only(algorithm: str, why: str | None) -> None:
    """Refuse a method whose `why` (its `Algorithm.simulator_only`) is set, before an
    engine other than the simulator starts anything: `hetfl serve` after validating the
    config, the Flower server when it is built."""
    if why is not None:
        raise SimulatorOnlyError(
            f"algorithm {algorithm!r} runs in the simulator only: {why}. Run it with "
            "`hetfl run CONFIG` (the in-process simulator; device profiles give its "
            "simulated time); `hetfl serve` and the Flower adapter cannot run it yet"
        )
