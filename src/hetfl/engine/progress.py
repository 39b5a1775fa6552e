"""Progress display: a live bar on a terminal, plain lines otherwise (logs, CI).

On a terminal (the stream is a tty, or a rich `Console` is given) the display is a
`rich.progress` bar: the run's label, the round, the bar, the time elapsed, the ETA and the
latest evaluated round's accuracy and loss; evaluated rounds and messages are printed as
lasting lines above it. Elsewhere each evaluated round is one plain line, in the format logs
are parsed by. rich is imported only when a bar is shown, so `hetfl --help` stays fast.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

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

    def round(self, round: int, row: dict[str, Any] | None) -> None:
        """Evaluated rounds (with a metrics row) get a lasting line; the bar moves on
        every round."""
        line = None
        if row is not None:
            elapsed = time.perf_counter() - self._start
            head = f"{self.label}round {round}/{self.total}  elapsed {elapsed:.1f}s"
            line = "  ".join(part for part in (head, row_text(row)) if part)
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
