"""Checks of a client's result against the task it was given, shared by every engine.

A result that fails a check is excluded from aggregation and recorded as a failure; the
run goes on. The `Problem` says what was wrong, for the log, and its kind, for the count of
failures in `summary.json`.
"""

from __future__ import annotations

import math

import torch

from hetfl.core.spec import local_names
from hetfl.core.types import ClientResult, ClientTask, Problem


def result_problem(result: ClientResult, task: ClientTask) -> Problem | None:
    """Why `result` cannot be aggregated for `task`, or None when it is well-formed."""
    if result.cid != task.cid:
        return Problem(
            "invalid", f"result is for client {result.cid}, task was for client {task.cid}"
        )
    expected = local_names(task.index_map)
    got = set(result.tensors)
    if got != set(expected):
        missing, extra = sorted(set(expected) - got), sorted(got - set(expected))
        return Problem(
            "invalid",
            f"result tensors do not match the index map (missing {missing}, unexpected {extra})",
        )
    for name in expected:
        tensor = result.tensors[name]
        want = task.payload[name].shape if name in task.payload else None
        if want is not None and tensor.shape != want:
            return Problem(
                "invalid",
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(want)}",
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return Problem("non-finite", f"tensor {name!r} has non-finite values")
    problem = upload_problem(result, task)
    if problem is not None:
        return problem
    if result.num_examples <= 0:
        return Problem("invalid", f"num_examples must be > 0, got {result.num_examples}")
    if not math.isfinite(result.loss):
        return Problem("non-finite", f"training loss is not finite ({result.loss})")
    return None


def upload_problem(result: ClientResult, task: ClientTask) -> Problem | None:
    """Why the result's non-parameter uploads do not match what its task declared
    (`ClientTask.uploads`: names and shapes) or hold non-finite values, or None."""
    got, want = set(result.uploads), set(task.uploads)
    if got != want:
        missing, extra = sorted(want - got), sorted(got - want)
        return Problem(
            "invalid", f"uploads do not match the task's (missing {missing}, unexpected {extra})"
        )
    for name, shape in task.uploads.items():
        tensor = result.uploads[name]
        if tuple(tensor.shape) != tuple(shape):
            return Problem(
                "invalid",
                f"upload {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}",
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return Problem("non-finite", f"upload {name!r} has non-finite values")
    return None
