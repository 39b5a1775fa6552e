"""The Ray executor: a round's units spread over Ray actors, on one machine or a cluster.

For simulations that outgrow one machine: the units (`hetfl.sim.tasks`) are those every
executor runs, on `units` Ray actors (`UnitActor`) that live for the run, each a worker
process holding `cpus_per_unit` CPUs (and `gpus_per_unit` GPUs) of the cluster. The
parent (aggregation, scheduling, the clock, the stores) stays in the process that runs
the simulation, as with the process executor.

- Where (`hetfl.sim.ray_session`): `address` None starts a local Ray for the run and
  shuts it down at `close` (a Ctrl-C reaches `close` through the runner's `finally`; a
  watchdog ends it when the driver is killed); "auto" or "host:port" joins a running
  cluster (`ray start --head` / `ray start --address`), once its address answers within
  `connect_timeout_s`, and leaves it running. A process already connected to Ray
  (`ray.init` by a library user, the tests' cluster) is used as it is and left connected.
- Data: the run's data (clients' samples, the test and validation sets) is placed in one
  block (`hetfl.sim.wire.SharedBuffer`) and put in Ray's object store once (`share`): a
  node holds it once, its actors map it without a copy, and views of it travel as
  references. The programs are put once per run.
- An exchange (a round's trainings, one evaluation) is encoded once with the process
  executor's wire format, with one `ray.put`: each tensor once, whatever the number of units
  that hold it (the round's global weights), views of the data as references. Each actor
  decodes it once and keeps it, with the round's models it loads (`WorkerContext`), for the
  exchange's units it is given.
- Units go to actors largest expected cost first, each actor taking the next when it
  answers; answers are returned in the units' order.
- The same numerics as the process executor's workers: each actor sets the run's intra-op
  thread count and determinism and imports the run's plugins before its first unit, and
  starts with the numeric pins of the driver's environment (`hetfl.engine.numerics`,
  `runtime_env` env vars), so that on one machine a unit computes the sequential
  executor's bits. Their heaps too: each actor sets its heap as a worker's and trims it
  when a new exchange arrives (`hetfl.engine.heap.tune_worker_heap`, `hetfl.sim.worker`).

Faults: actors run with `max_restarts=0` and `max_task_retries=0`. An actor that dies
fails the unit it was running, answered as the process executor answers a dead worker's
(`hetfl.sim.tasks.died_while_training`: for a training unit that client fails this round,
counted as "raised"), and is replaced; the other units go on. A unit that raises stops the
run with its traceback (training units turn their own exceptions into outcomes).

Split learning runs as under the process executor: the round's server program travels in
each client's item (`train_with_server`), and a client and its server session compute in
the same actor.
"""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar, cast

import numpy as np
import torch

from hetfl.core.client.program import Programs
from hetfl.core.plugins import load_plugins
from hetfl.core.server_program import ServerProgram
from hetfl.core.types import ClientData
from hetfl.engine.device import make_deterministic
from hetfl.engine.heap import trim_heap, tune_worker_heap
from hetfl.engine.numerics import NUMERIC_ENV
from hetfl.engine.watchdog import Watchdog
from hetfl.sim.ray_session import CONNECT_TIMEOUT_S, join, start_local
from hetfl.sim.tasks import (
    ClientJob,
    TaskOutcome,
    WorkerContext,
    train_as_units,
)
from hetfl.sim.wire import Receiver, Sender, SharedBuffer

T = TypeVar("T")
R = TypeVar("R")

MISSING = (
    "executor 'ray' needs Ray, which is not installed: pip install 'hetfl[ray]' "
    "(or use executor 'processes' on one machine)"
)


#: The niceness of a local Ray's workers: the units are the run's work, as the process
#: executor's workers are (Ray's default, 15, leaves them only the cycles others spare).
WORKER_NICENESS = 0


@dataclass(frozen=True)
class RaySettings:
    """Where the Ray executor runs (`ray:` in a run's config, docs/ray.md): `address`
    None starts a local Ray, "auto" or "host:port" joins a cluster once it accepts a
    connection within `connect_timeout_s`; each unit's actor holds `cpus_per_unit` CPUs
    and `gpus_per_unit` GPUs."""

    address: str | None = None
    cpus_per_unit: float = 1.0
    gpus_per_unit: float = 0.0
    connect_timeout_s: float = CONNECT_TIMEOUT_S


def import_ray() -> Any:
    """Ray, imported only by a run that asks for it, or an error naming the extra."""
    try:
        import ray
    except ImportError as error:
        raise ImportError(MISSING) from error
    return ray


class UnitFailed(RuntimeError):
    """A unit raised in an actor (its traceback in the message)."""


class _Frames:
    """A pipe's stand-in for `Sender` and `Receiver`: the frames of one message, recorded
    (`send_bytes`) or replayed (`recv_bytes`)."""

    def __init__(self, frames: Sequence[Any] = ()) -> None:
        self.frames = list(frames)
        self._next = 0

    def send_bytes(self, data: Any) -> None:
        self.frames.append(np.frombuffer(data, dtype=np.uint8))

    def recv_bytes(self) -> bytes:
        frame = self.frames[self._next]
        self._next += 1
        return bytes(frame)

    def recv_bytes_into(self, buffer: bytearray) -> int:
        frame = self.frames[self._next]
        self._next += 1
        buffer[: frame.nbytes] = memoryview(frame).cast("B")
        return int(frame.nbytes)


class UnitActor:
    """One Ray actor of the executor: runs units one at a time and keeps what they share
    (the data block, the programs, the current exchange and its round models), each
    fetched from the object store once."""

    def __init__(self, threads: int, device: str, deterministic: bool, plugins: Sequence[str]):
        tune_worker_heap(os.environ)  # a worker's heap, as the process executor's workers'
        torch.set_num_threads(threads)
        make_deterministic(torch.device(device), deterministic)
        load_plugins(plugins)
        self._held: dict[str, Any] = {}  # role -> (object id, value)
        self._shared: SharedBuffer | None = None
        self._ctx: WorkerContext | None = None
        self._units: tuple[Callable[..., Any], Sequence[Any]] | None = None

    def run(self, refs: list[Any], index: int) -> tuple[str, Any]:
        """Unit `index` of the exchange `refs` = [block | None, programs, exchange] name
        (in a list, so that Ray passes the references, not their values): ("done",
        answer), or ("error", traceback) when the unit raised."""
        try:
            unit, items = self._exchange(*refs)
            assert self._ctx is not None
            return "done", unit(self._ctx, items[index])
        except Exception:
            return "error", traceback.format_exc()

    def node(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def _exchange(self, block: Any, programs: Any, exchange: Any) -> tuple[Callable, Sequence]:
        if block is not None and self._fresh("block", block):
            with warnings.catch_warnings():  # the store's memory is read-only: units only read
                warnings.simplefilter("ignore", UserWarning)
                self._shared = SharedBuffer(torch.from_numpy(self._held["block"][1]))
        if self._fresh("programs", programs):
            self._ctx = WorkerContext(self._held["programs"][1])
        if self._fresh("exchange", exchange) or self._units is None:
            trim_heap()  # the last exchange's freed blocks back, before this one's
            receiver = Receiver(cast(Connection, _Frames(self._held["exchange"][1])), self._shared)
            self._units = receiver.recv()
        return self._units

    def _fresh(self, role: str, ref: Any) -> bool:
        """Fetch `ref` for `role` unless it is the one held."""
        import ray

        held = self._held.get(role)
        if held is not None and held[0] == ref.hex():
            return False
        self._held[role] = (ref.hex(), ray.get(ref))
        return True


class RayExecutor:
    """Runs units on `units` Ray actors (default: as many as the cluster's CPUs and GPUs
    allow), each of `threads` intra-op threads. Use as a context manager, or call
    `close()`."""

    def __init__(
        self,
        settings: RaySettings = RaySettings(),
        *,
        units: int | None = None,
        threads: int = 1,
        device: str = "cpu",
        deterministic: bool = True,
        plugins: Sequence[str] = (),
    ) -> None:
        on_gpu = torch.device(device).type == "cuda"
        if on_gpu != (settings.gpus_per_unit > 0):
            raise ValueError(
                f"executor 'ray' on device {device!r} with ray.gpus_per_unit = "
                f"{settings.gpus_per_unit}: units on GPUs need both device 'cuda' and "
                "ray.gpus_per_unit > 0, units on CPUs neither"
            )
        if torch.device(device).type not in ("cpu", "cuda"):
            raise ValueError(f"executor 'ray' runs units on CPUs or CUDA GPUs, not {device!r}")
        self.ray = ray = import_ray()
        self.settings, self.threads = settings, threads
        self.started = not ray.is_initialized() and settings.address is None
        self._watchdog: Watchdog | None = None
        if self.started:
            # Ray runs workers at niceness 15 by default: behind any other work of the machine
            self._watchdog = start_local(
                ray,
                include_dashboard=False,
                _system_config={"worker_niceness": WORKER_NICENESS},
            )
        elif not ray.is_initialized() and settings.address is not None:
            join(ray, settings.address, settings.connect_timeout_s)
        self.units = units or self._capacity()
        pins = {k: os.environ[k] for k in NUMERIC_ENV if k in os.environ}
        self._actor = ray.remote(
            num_cpus=settings.cpus_per_unit,
            num_gpus=settings.gpus_per_unit,
            max_restarts=0,
            max_task_retries=0,
            runtime_env={"env_vars": pins} if pins else None,
        )(UnitActor)
        self._args = (threads, device, deterministic, tuple(plugins))
        self._actors: list[Any] = []
        self._start()
        self._shared: SharedBuffer | None = None
        self._block: Any = None
        self._programs: tuple[Programs, Any] | None = None
        self.restarts = 0

    def _capacity(self) -> int:
        """How many units the cluster holds at once, by CPUs and GPUs."""
        resources = self.ray.cluster_resources()
        fit = int(resources.get("CPU", 0) // self.settings.cpus_per_unit)
        if self.settings.gpus_per_unit:
            fit = min(fit, int(resources.get("GPU", 0) // self.settings.gpus_per_unit))
        if fit < 1:
            raise ValueError(
                f"the Ray cluster ({resources}) has no room for one unit of "
                f"{self.settings.cpus_per_unit} CPU(s) and {self.settings.gpus_per_unit} "
                "GPU(s): lower ray.cpus_per_unit / ray.gpus_per_unit, or add nodes"
            )
        return fit

    def _start(self) -> None:
        while len(self._actors) < self.units:
            self._actors.append(self._actor.remote(*self._args))

    # -- the Executor protocol -----------------------------------------------------------
    def share(self, data: T) -> T:
        """`data` rebuilt on one block put in Ray's object store once; the engine keeps
        the returned copy, whose tensors travel to the actors as references."""
        self._shared, placed = SharedBuffer.place(data)
        self._block = self.ray.put(self._shared.block.numpy())
        return placed

    def run(
        self,
        programs: Programs,
        jobs: Sequence[ClientJob],
        clients: Mapping[int, ClientData],
        server: ServerProgram | None,
    ) -> list[TaskOutcome]:
        return train_as_units(self.map, programs, jobs, clients, server)

    def map(
        self,
        programs: Programs,
        unit: Callable[[Any, T], R],
        items: Sequence[T],
        costs: Sequence[float] | None = None,
        on_death: Callable[[T, str], R] | None = None,
    ) -> list[R]:
        """`unit(ctx, item)` for every item, on the actors, answers in the items' order.
        `on_death(item, why)` answers for an item whose actor died running it (default:
        the run stops)."""
        if not items:
            return []
        self._start()
        refs = [self._block, self._programs_ref(programs), self._put(unit, items)]
        try:
            answers = self._exchange(refs, items, costs, on_death)
        except UnitFailed:
            raise
        except BaseException:
            self._kill()  # units may still run on the actors: start afresh at the next exchange
            raise
        return [answers[i] for i in range(len(items))]

    def _exchange(
        self,
        refs: list[Any],
        items: Sequence[T],
        costs: Sequence[float] | None,
        on_death: Callable[[T, str], R] | None,
    ) -> dict[int, R]:
        ray = self.ray
        order = sorted(range(len(items)), key=lambda i: (-(costs[i] if costs else 0.0), i))
        pending = list(reversed(order))  # pop() takes the largest first
        answers: dict[int, R] = {}
        running: dict[Any, tuple[int, int]] = {}  # answer ref -> (actor slot, item index)

        def give(slot: int) -> None:
            if pending:
                index = pending.pop()
                running[self._actors[slot].run.remote(refs, index)] = (slot, index)

        for slot in range(len(self._actors)):
            give(slot)
        while running:
            done, _ = ray.wait(list(running), num_returns=1)
            slot, index = running.pop(done[0])
            try:
                kind, value = ray.get(done[0])
            except ray.exceptions.RayActorError as died:
                self._actors[slot] = self._actor.remote(*self._args)
                self.restarts += 1
                why = f"its Ray actor died ({_first_line(died)})"
                if on_death is None:
                    raise RuntimeError(f"a unit's {why}") from died
                answers[index] = on_death(items[index], why)
            else:
                if kind == "error":
                    # the actors stay: the units they run finish, unread
                    ray.wait(list(running), num_returns=len(running))
                    raise UnitFailed(f"a unit failed in a Ray actor:\n{value}")
                answers[index] = value
            give(slot)
        return answers

    def close(self) -> None:
        """Stop every actor, and the local Ray this executor started."""
        self._kill()
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()
            self.started = False
        if self._watchdog is not None:
            self._watchdog.close()  # and whatever of the local Ray outlived its shutdown
            self._watchdog = None

    def _kill(self) -> None:
        actors, self._actors = self._actors, []
        for actor in actors:
            with contextlib.suppress(Exception):  # an actor already gone
                self.ray.kill(actor, no_restart=True)

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        where = (
            "a local Ray" if self.started else f"Ray at {self.settings.address or 'this process'}"
        )
        gpus = f" + {self.settings.gpus_per_unit} GPU" if self.settings.gpus_per_unit else ""
        return (
            f"ray ({self.units} units x {self.threads} thread(s), "
            f"{self.settings.cpus_per_unit} CPU{gpus} each, on {where})"
        )

    # -- the object store ------------------------------------------------------------------
    def _programs_ref(self, programs: Programs) -> Any:
        if self._programs is None or self._programs[0] is not programs:
            self._programs = (programs, self.ray.put(programs))
        return self._programs[1]

    def _put(self, unit: Callable[..., Any], items: Sequence[Any]) -> Any:
        """The exchange's unit and items in the object store, with one `ray.put`: the
        wire format's frames, each tensor once, views of the data as references."""
        frames = _Frames()
        Sender(cast(Connection, frames), self._shared).send((unit, list(items)))
        return self.ray.put(frames.frames)


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
