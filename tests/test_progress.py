"""The progress display: plain lines when stderr is not a terminal (logs, CI parse them),
a live rich bar with round, ETA, accuracy and loss when it is."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from hetfl.algorithms import ALGORITHMS
from hetfl.core.client.program import Programs
from hetfl.core.training import LocalTraining
from hetfl.engine.progress import Progress
from hetfl.engine.round_settings import RoundSettings
from hetfl.sim import Simulation

ROW = {"global_acc": 0.5, "local_acc": None, "loss": 1.25, "failed": 0}
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


def test_plain_lines_when_not_a_terminal():
    """Not a terminal: a lasting line per evaluated round, nothing for the others, messages
    as they are; the format logs are parsed by."""
    stream = io.StringIO()
    progress = Progress(3, label="[1/2 fedavg-s0] ", stream=stream)
    progress.message("resuming after round 1")
    progress.round(2, None)
    progress.round(3, {**ROW, "failed": 2})
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "resuming after round 1"
    assert re.fullmatch(
        r"\[1/2 fedavg-s0\] round 3/3  elapsed \d+\.\ds  global_acc 0\.5000  loss 1\.2500  "
        r"failed 2",
        lines[1],
    ), lines[1]
    assert len(lines) == 2
    assert "\r" not in stream.getvalue() and "\033" not in stream.getvalue()


def test_disabled_progress_writes_nothing():
    stream = io.StringIO()
    progress = Progress(3, stream=stream, enabled=False)
    progress.message("x")
    progress.round(1, ROW)
    progress.close()
    assert stream.getvalue() == ""


def _recording_console() -> Console:
    return Console(record=True, force_terminal=True, width=160, file=io.StringIO())


def test_the_bar_shows_round_eta_accuracy_and_loss():
    console = _recording_console()
    progress = Progress(3, label="[1/2 fedavg-s0] ", console=console)
    progress.round(1, None)
    progress.round(2, ROW)
    progress.close()
    text = console.export_text()
    # The bar's last state: label (brackets kept, not read as markup), round, elapsed,
    # an ETA (timed from round 1 to round 2) and the latest evaluated round's metrics.
    assert re.search(
        r"\[1/2 fedavg-s0\] round 2/3 ━+\S* +\d:\d\d:\d\d ETA \d:\d\d:\d\d "
        r"global_acc 0\.5000  loss 1\.2500",
        text,
    ), text
    # The evaluated round also left its plain line above the bar.
    assert re.search(
        r"\[1/2 fedavg-s0\] round 2/3  elapsed \d+\.\ds  global_acc 0\.5000  loss 1\.2500", text
    )


def test_an_interrupt_leaves_the_terminal_sane(synthetic_federation, tmp_path):
    """Ctrl-C in the middle of a run stops the live bar: the cursor it hid is shown again."""
    family, clients, test = synthetic_federation
    strategy, recipe = ALGORITHMS.get("fedavg").build(
        family, None, clients_per_round=2, train=LocalTraining(lr=0.1, epochs=1, batch_size=16)
    )
    console = _recording_console()
    sim = Simulation(
        strategy,
        Programs(family, recipe, seed=0),
        clients,
        test,
        RoundSettings(rounds=3, seed=0),
        tmp_path,
        progress=Progress(3, console=console),
    )
    train = sim.train

    def interrupted(rnd, tasks):
        if rnd == 2:
            raise KeyboardInterrupt
        return train(rnd, tasks)

    sim.train = interrupted
    with pytest.raises(KeyboardInterrupt):
        sim.run()
    written = console.file.getvalue()
    assert HIDE_CURSOR in written
    assert written.rindex(SHOW_CURSOR) > written.rindex(HIDE_CURSOR)
