"""The wire format of the Flower adapter: every protocol message round-trips exactly.

These tests need no Flower: the codec is plain. The last ones check the Flower records
layer (skipped without the `flower` extra), where tensors go through NumPy.
"""

from __future__ import annotations

import math

import pytest
import torch

from hetfl.core.schedule import LrSchedule
from hetfl.core.spec import MapEntry, Spec, prefix_index
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo, ClientResult, ClientTask, EvalTask, PassRecord
from hetfl.deploy.codec import CodecError, decode, encode


def roundtrip(value):
    header, tensors = encode(value)
    assert isinstance(header, str)
    # What crosses the wire is the header text and the tensors: nothing shared with `value`.
    sent = {k: v.clone() for k, v in tensors.items()}
    return decode(header, sent)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def same_map(a: list[MapEntry], b: list[MapEntry]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if (x.local, x.global_name, len(x.index)) != (y.local, y.global_name, len(y.index)):
            return False
        for s, t in zip(x.index, y.index, strict=True):
            if isinstance(s, slice):
                if not (
                    isinstance(t, slice) and (s.start, s.stop, s.step) == (t.start, t.stop, t.step)
                ):
                    return False
            elif not (isinstance(t, torch.Tensor) and same_tensor(s, t)):
                return False
        if (x.mask is None) != (y.mask is None):
            return False
        if x.mask is not None and not same_tensor(x.mask, y.mask):
            return False
    return True


SPEC = Spec(model="mlp", input_shape=(1, 8, 8), num_classes=10, widths=(0.5, 1.0), rate=0.25)


def test_spec_roundtrips_with_tuples_and_stays_hashable():
    nested = SPEC.replace(tiers={"a": 1, "b": (2, 3)}, flag=True, none=None)
    back = roundtrip(nested)
    assert isinstance(back, Spec)
    assert back == nested and hash(back) == hash(nested)
    assert back["input_shape"] == (1, 8, 8) and isinstance(back["widths"], tuple)


def test_index_map_with_slices_index_tensors_masks_and_repeats():
    imap = [
        MapEntry("w", "W", prefix_index(8, 3)),
        MapEntry("w", "W2", (slice(2, 10, 2), torch.tensor([0, 4, 1]))),  # a repeat
        MapEntry(
            "b", "B", (torch.tensor([3, 1], dtype=torch.int32),), mask=torch.tensor([1.0, 0.0])
        ),
        MapEntry("head", "head", (), mask=torch.tensor([[True, False], [False, True]])),
        MapEntry("all", "all"),
    ]
    back = roundtrip(imap)
    assert same_map(back, imap)


def test_client_task_roundtrips_payload_bits_and_config():
    payload = {
        "w": torch.randn(8, 3, generator=torch.Generator().manual_seed(0)),
        "steps": torch.tensor(7),  # zero-dimensional, integer
        "half": torch.randn(4, dtype=torch.float64),
        "empty": torch.zeros(0, 5),
    }
    task = ClientTask(
        cid=3,
        spec=SPEC,
        payload=payload,
        index_map=[MapEntry("w", "W", prefix_index(8, 3))],
        config=LocalTraining(
            lr=0.05,
            lr_schedule=LrSchedule("step", (0.5, 0.75), 0.1, 0.25),
            steps=3,
            clip_grad_norm=1.0,
            decay_norm_and_bias=False,
        ),
    )
    back = roundtrip(task)
    assert isinstance(back, ClientTask)
    assert back.cid == 3 and back.spec == SPEC and back.kind == "fit"
    assert set(back.payload) == set(payload)
    assert all(same_tensor(back.payload[k], payload[k]) for k in payload)
    assert back.config == task.config and isinstance(back.config.lr_schedule.milestones, tuple)
    assert same_map(back.index_map, task.index_map)


def test_client_result_with_passes_extras_and_a_nan_loss():
    result = ClientResult(
        cid=1,
        tensors={"w": torch.arange(6.0).reshape(2, 3)},
        num_examples=120,
        num_steps=8,
        loss=float("nan"),
        passes=[PassRecord(SPEC, "train", 32, 7), PassRecord(SPEC, "forward", 16, 1, width=0.5)],
        metrics={"acc": 0.5},
        extras={"a_norm": 3.25, "steps": 8, "per_width": {"0.5": torch.ones(3)}},
    )
    back = roundtrip(result)
    assert isinstance(back, ClientResult)
    assert math.isnan(back.loss)  # must reach the server's check, not vanish in transit
    assert back.passes == result.passes
    assert back.metrics == result.metrics
    assert back.extras["a_norm"] == 3.25 and back.extras["steps"] == 8
    assert same_tensor(back.extras["per_width"]["0.5"], torch.ones(3))
    assert same_tensor(back.tensors["w"], result.tensors["w"])


def test_client_info_and_eval_task():
    info = ClientInfo(4, 91, (1, 8, 8), (0, 3, 9), attrs={"architecture": "deep", "tier": 2})
    back = roundtrip(info)
    assert back == info and isinstance(back.input_shape, tuple) and isinstance(back.labels, tuple)
    task = EvalTask(4, SPEC, {"w": torch.ones(2)}, [MapEntry("w", "W", (slice(0, 2),))], "group=a")
    back = roundtrip(task)
    assert isinstance(back, EvalTask) and back.group == "group=a" and back.spec == SPEC


def test_refuses_what_it_cannot_send_and_headers_it_cannot_read():
    with pytest.raises(CodecError, match="cannot send a value of type object"):
        encode({"x": object()})
    with pytest.raises(CodecError, match="keys must be strings"):
        encode({1: 2})
    with pytest.raises(CodecError, match=r"unknown tag 'os\.system'"):
        decode('{"os.system": {"command": "true"}}', {})
    with pytest.raises(CodecError, match="names tensor 't0', which was not sent"):
        decode('{"tensor": "t0"}', {})
    with pytest.raises(CodecError, match="not valid JSON"):
        decode("{", {})
    with pytest.raises(CodecError, match="does not fit ClientInfo"):
        decode('{"ClientInfo": {"cid": 1}}', {})


def test_a_task_config_with_an_unknown_setting_does_not_decode():
    """A local-training setting the client's record lacks (a newer server's, or a typo) is
    refused by name, not dropped: the client would otherwise train without it."""
    header, tensors = encode(ClientTask(0, SPEC, {}, [], LocalTraining(lr=0.1)))
    assert '"LocalTraining":{"lr":0.1,' in header
    bad = header.replace('"LocalTraining":{"lr":0.1,', '"LocalTraining":{"lr":0.1,"mu":0.01,')
    with pytest.raises(CodecError, match=r"does not fit LocalTraining: .*'mu'"):
        decode(bad, tensors)
    sent_as_dict = header.replace('{"LocalTraining":', '{"dict":')
    with pytest.raises(CodecError, match="must be a LocalTraining record, got dict"):
        decode(sent_as_dict, tensors)


def test_flower_records_keep_exact_bits():
    pytest.importorskip("flwr")
    from hetfl.deploy.records import from_content, to_content

    payload = {"w": torch.randn(5, 4, dtype=torch.float32), "n": torch.tensor([3, 1])}
    task = ClientTask(
        0, SPEC, payload, [MapEntry("w", "W", (torch.tensor([2, 0]),))], LocalTraining(lr=0.1)
    )
    back = from_content(to_content({"round": 2, "task": task}))
    assert back["round"] == 2
    assert all(same_tensor(back["task"].payload[k], payload[k]) for k in payload)
    assert same_map(back["task"].index_map, task.index_map)


def test_flower_records_refuse_foreign_content():
    pytest.importorskip("flwr")
    from flwr.app import ConfigRecord, RecordDict

    from hetfl.deploy.records import from_content

    with pytest.raises(CodecError, match="not a HetFL message"):
        from_content(RecordDict({"config": ConfigRecord({"lr": 0.1})}))
