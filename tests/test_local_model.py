"""The one local-evaluation part (`hetfl.core.server.evaluation.LocalModel`): the task it
builds is the picked model's, loaded with the global tensors of the trained spec's shared
map, with the statistics pass, label mask and group as asked."""

from __future__ import annotations

import pytest
import torch

from hetfl.core.server.evaluation import (
    Judged,
    Layout,
    LocalModel,
    fixed_spec,
    global_model,
    own_spec,
)
from hetfl.core.spec import full_map
from hetfl.core.types import ClientInfo
from hetfl.models.base import PlainFamily

FAMILY = PlainFamily("linear", (2,), 3)
GLOBAL = FAMILY.global_spec([])
OWN = GLOBAL.replace(tag="own")  # a spec of its own, never built here
STATE = {"w": torch.arange(6.0).reshape(3, 2), "b": torch.ones(3)}
INFO = ClientInfo(7, 10, (2,), (0, 2), {})


def _layout() -> Layout:
    return Layout(
        FAMILY,
        GLOBAL,
        spec_of=lambda info: OWN,
        shared_map=lambda spec: full_map(STATE) if spec == GLOBAL else full_map({"w": STATE["w"]}),
    )


def test_the_default_judges_a_client_by_its_own_spec_with_the_global_tensors() -> None:
    task = LocalModel(own_spec(group=lambda info: f"g{info.cid}")).eval_task(
        _layout(), INFO, STATE, {}
    )
    assert (task.cid, task.spec, task.group) == (7, OWN, "g7")
    assert set(task.payload) == {"w"} and torch.equal(task.payload["w"], STATE["w"])
    assert not task.stats_pass and task.label_mask is None


def test_the_evaluated_spec_the_pass_and_the_mask_are_as_asked() -> None:
    later = GLOBAL.replace(bn="batch")
    part = LocalModel(lambda layout, info: Judged(GLOBAL, later), stats_pass=True, label_mask=True)
    task = part.eval_task(_layout(), INFO, STATE, {})
    assert task.spec == later and task.stats_pass and task.label_mask == (0, 2)
    assert set(task.payload) == {"w", "b"}  # the trained spec's map, not the evaluated one's
    assert LocalModel(global_model).eval_task(_layout(), INFO, STATE, {}).spec == GLOBAL


def test_present_only_loads_what_the_state_holds_and_otherwise_a_missing_tensor_is_an_error():
    layout = _layout()
    partial = {"w": STATE["w"]}
    task = LocalModel(fixed_spec(GLOBAL), present_only=True).eval_task(layout, INFO, partial, {})
    assert [e.global_name for e in task.index_map] == ["w"] and set(task.payload) == {"w"}
    with pytest.raises(KeyError, match="'b'"):
        LocalModel(fixed_spec(GLOBAL)).eval_task(layout, INFO, partial, {})
