"""Experiment tracking: the `metrics.jsonl` rows, also as TensorBoard event files.

A tracker is a `hetfl.engine.outputs.RowSink`: `MetricsLog` hands it every row it writes
and every truncation it makes, so a tracker holds exactly what `metrics.jsonl` holds.

TensorBoard (`tracking: tensorboard`, the `hetfl[tensorboard]` extra) gets one scalar per
number of a row at step = the row's `round`: the tag is the row's key (`global_acc`,
`bytes_up`, ...) and a nested key is its path joined by "/" (`groups/width=0.5/acc`,
`groups/width=0.5/n`, `defence/kept`; booleans as 0 or 1); nulls and text (`defence/kind`)
are not written. Scalars are written in double precision, so
the event values equal the row's (byte counts beyond 2**24 included).

On resume, `rewrite` deletes the run's event files and writes the kept rows again: the
events are a function of `metrics.jsonl` alone, whatever a crash left behind (TensorBoard's
`purge_step` would instead rely on every reader honouring a purge marker in the file).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetfl.engine.outputs import RowSink

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

#: The folder of a run directory that holds its TensorBoard event files.
TENSORBOARD_DIR = "tensorboard"
#: How a config asks for the extra, named in the error when it is missing.
TENSORBOARD_INSTALL = "pip install 'hetfl[tensorboard]'"


def scalars(row: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) for every number of `row` but its `round` (the step), nested keys
    joined by "/", booleans as 0 or 1 (`defence/fallback`); None values and text (a
    defence's `kind`) are skipped."""
    for key, value in row.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from scalars(value, f"{tag}/")
        elif isinstance(value, int | float) and tag != "round":
            yield tag, float(value)


class TensorBoardSink:
    """The rows as scalars in `log_dir`'s event file, flushed after each row (as
    `metrics.jsonl` is), so a killed run's events reach its last row."""

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError(
                f"tracking: 'tensorboard' needs the tensorboard package, which is not "
                f"installed: {TENSORBOARD_INSTALL}"
            ) from None
        self.log_dir = log_dir
        self._make_writer = SummaryWriter
        self._writer: SummaryWriter | None = None

    def append(self, row: dict[str, Any]) -> None:
        self._add(row)
        self._open().flush()

    def rewrite(self, rows: Sequence[dict[str, Any]]) -> None:
        self.close()
        for old in self.log_dir.glob("events.out.tfevents.*"):
            old.unlink()
        for row in rows:
            self._add(row)
        self._open().flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _open(self) -> SummaryWriter:
        if self._writer is None:
            self._writer = self._make_writer(str(self.log_dir))
        return self._writer

    def _add(self, row: dict[str, Any]) -> None:
        writer = self._open()
        for tag, value in scalars(row):
            writer.add_scalar(tag, value, row["round"], new_style=True, double_precision=True)


def make_sinks(tracking: str, run_dir: Path) -> list[RowSink]:
    """The sinks `tracking` ("none" or "tensorboard") asks for, writing into `run_dir`;
    a ValueError naming the pip command when the tensorboard extra is not installed."""
    if tracking == "none":
        return []
    if tracking == "tensorboard":
        return [TensorBoardSink(run_dir / TENSORBOARD_DIR)]
    raise ValueError(f"tracking: unknown tracker {tracking!r}; allowed: none, tensorboard")
