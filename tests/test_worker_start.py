"""The process executor's start: done when every worker is ready (so round 1 holds no
worker start-up), a worker that dies setting up fails the start, and a worker keeps the
objects it inherited from the fork server out of the cyclic collector (`gc.freeze`)."""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import pytest
import torch

from golden.harness import BY_NAME
from hetfl.config import validate
from hetfl.runner import build_simulation
from hetfl.sim import ProcessExecutor


def _frozen(ctx, item: int) -> tuple[int, int]:
    """What a worker's collector leaves alone, and the unit's own answer."""
    return gc.get_freeze_count(), item + 1


def test_after_share_every_worker_is_ready_and_keeps_its_inherited_objects_frozen():
    raw = copy.deepcopy(BY_NAME["fedavg"].config)
    programs = build_simulation(validate(raw), Path("unused"), show_progress=False).programs
    with ProcessExecutor(2) as executor:
        executor.share({"x": torch.zeros(3)})
        # The start consumed each worker's "ready": nothing is left unread on any pipe.
        assert not any(w.conn.poll() for w in executor._pool)
        answers = executor.map(programs, _frozen, [1, 2, 3])
    assert [a for _, a in answers] == [2, 3, 4]
    # The fork server holds torch and HetFL imported: far more than 10,000 objects.
    assert all(frozen > 10_000 for frozen, _ in answers)


def test_a_worker_that_dies_setting_up_fails_the_start():
    executor = ProcessExecutor(1, plugins=["hetfl_no_such_plugin_module"])
    with pytest.raises(RuntimeError, match=r"1 worker process\(es\) did not start: WorkerDied"):
        executor.share({"x": torch.zeros(3)})
    executor.close()
