"""Progress display: one updating line on a terminal, plain lines otherwise (logs, CI)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    def __init__(
        self, total_rounds: int, label: str = "", stream: TextIO | None = None, enabled: bool = True
    ) -> None:
        self.total = total_rounds
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self._start = time.perf_counter()

    def message(self, text: str) -> None:
        if self.enabled:
            self._finish_line()
            print(text, file=self.stream, flush=True)

    def _finish_line(self) -> None:
        if self.tty:
            print("\r\033[K", end="", file=self.stream)

    def round(self, round: int, row: dict[str, Any] | None) -> None:
        """Evaluated rounds (with a metrics row) get a lasting line; others a transient one."""
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self._start
        bar = f"{self.label}round {round}/{self.total}  {elapsed:6.1f}s"
        if row is not None:
            parts = [bar]
            for key in ("global_acc", "local_acc", "loss"):
                if row.get(key) is not None:
                    parts.append(f"{key} {row[key]:.4f}")
            if row.get("failed"):
                parts.append(f"failed {row['failed']}")
            self._finish_line()
            print("  ".join(parts), file=self.stream, flush=True)
        elif self.tty:
            print(f"\r\033[K{bar}", end="", file=self.stream, flush=True)

    def close(self) -> None:
        if self.enabled:
            self._finish_line()
