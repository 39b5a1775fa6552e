"""Progress display: a live bar on a terminal, plain lines otherwise (logs, CI).

On a terminal (the stream is a tty, or a rich `Console` is given) the display is a
`rich.progress` bar: the run's label, the round, the bar, the time elapsed, the ETA and the
latest evaluated round's accuracy and loss; evaluated rounds and messages are printed as
lasting lines above it. Elsewhere each evaluated round is one plain line, in the format logs
are parsed by. rich is imported only when a bar is shown, so `hetfl --help` stays fast.

No phase is silent (issue 48): a phase before round 1 (the data's loading, the strategy's
set-up queries) says when it starts, how far it is (`step`) and how long it took; a
round's line ends with its phases' wall seconds (`train 6.1s  eval 2.3s`). Every phase is
timed into `phases` (`hetfl.engine.phases`) whether or not anything is shown, for
`summary.json`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TextIO

from hetfl.engine.phases import PhaseLog

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID

#: The metrics an evaluated round shows, in this order, where the row has them.
SHOWN = ("global_acc", "local_acc", "loss")


def row_text(row: dict[str, Any]) -> str:
    """`global_acc 0.8123  loss 0.4012  failed 2`: the row's shown metrics and failures."""
    parts = [f"{key} {row[key]:.4f}" for key in SHOWN if row.get(key) is not None]
    if row.get("failed"):
        parts.append(f"failed {row['failed']}")
    return "  ".join(parts)


class Progress:
    """The run's progress display; `enabled=False` shows nothing. `console` forces the bar
    onto that rich console (tests record one); otherwise the bar is shown when `stream`
    (default stderr) is a terminal."""

    def __init__(
        self,
        total_rounds: int,
        label: str = "",
        stream: TextIO | None = None,
        enabled: bool = True,
        console: Console | None = None,
    ) -> None:
        self.total = total_rounds
        self.label = label
        self._start = time.perf_counter()
        self.phases = PhaseLog()
        self._bar: _Bar | None = None
        self._stream: TextIO | None = None
        if not enabled:
            return
        stream = stream or sys.stderr
        if console is None and stream.isatty():
            from rich.console import Console

            console = Console(file=stream)
        if console is not None:
            self._bar = _Bar(total_rounds, label, console)
        else:
            self._stream = stream

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.print(text)
        elif self._stream is not None:
            print(text, file=self._stream, flush=True)

    @contextmanager
    def phase(self, name: str, rnd: int | None = None, about: str = "") -> Iterator[None]:
        """Time the block as phase `name` of round `rnd` (shown on the round's line) or,
        with no round, of the set-up: then its start (with `about`) and its end are shown."""
        if rnd is not None:
            with self.phases.timed(name, rnd):
                yield
            return
        self.message(f"{self.label}{name}: {about}" if about else f"{self.label}{name} ...")
        with self.phases.timed(name):
            yield
        spent = self.phases.setup[name]
        self.message(f"{self.label}{name}: done in {spent.wall_s:.1f}s (cpu {spent.cpu_s:.1f}s)")

    def step(self, name: str, done: int, total: int, unit: str) -> None:
        """How far a set-up phase is: `done` of `total` `unit`s."""
        elapsed = time.perf_counter() - self._start
        self.message(f"{self.label}{name}: {done}/{total} {unit}  elapsed {elapsed:.1f}s")

    def round(self, round: int, row: dict[str, Any] | None) -> None:
        """Evaluated rounds (with a metrics row) get a lasting line, with the round's
        phases' wall seconds; the bar moves on every round."""
        line = None
        if row is not None:
            elapsed = time.perf_counter() - self._start
            head = f"{self.label}round {round}/{self.total}  elapsed {elapsed:.1f}s"
            timed = self.phases.rounds.get(round, {})
            times = "  ".join(f"{name} {t.wall_s:.1f}s" for name, t in timed.items())
            line = "  ".join(part for part in (head, row_text(row), times) if part)
        if self._bar is not None:
            self._bar.advance(round, row, line)
        elif self._stream is not None and line is not None:
            print(line, file=self._stream, flush=True)

    def close(self) -> None:
        """Stop the bar (restoring the cursor); safe to call more than once."""
        if self._bar is not None:
            self._bar.stop()


class _Bar:
    """The rich bar of one run. It starts at the first round (so the start banner and
    registration messages print before it) and stops at `stop`. The ETA is rich's, from
    the speed of every round since the bar started (a first round with no earlier one to
    time against shows none)."""

    def __init__(self, total_rounds: int, label: str, console: Console) -> None:
        from rich.progress import (
            BarColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        self.bar: RichProgress = RichProgress(
            TextColumn("{task.description}round {task.completed}/{task.total}", markup=False),
            BarColumn(bar_width=20),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}", markup=False),
            console=console,
            # rounds can take minutes: time every round of the run, not rich's last 30 s
            speed_estimate_period=float("inf"),
        )
        self.task: TaskID = self.bar.add_task(label, total=total_rounds, completed=0, metrics="")
        self.started = False

    def print(self, text: str) -> None:
        self.bar.console.print(text, markup=False, highlight=False)

    def advance(self, round: int, row: dict[str, Any] | None, line: str | None) -> None:
        if row is not None:
            self.bar.update(self.task, metrics=row_text(row))
        self.bar.update(self.task, completed=round)
        if not self.started:
            self.bar.start()
            self.started = True
        if line is not None:
            self.print(line)
        self.bar.refresh()

    def stop(self) -> None:
        if self.started:
            self.bar.stop()
            self.started = False
