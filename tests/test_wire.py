"""The process executor's wire format: values, dtypes and layouts arrive exact; a tensor
repeated within an exchange travels once; views of the shared block travel as references."""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

import pytest
import torch
from torch import nn

from hetfl.sim.wire import Receiver, Sender, SharedBuffer


def _through(sender: Sender, receiver: Receiver, value: Any) -> tuple[Any, int]:
    """`value` sent and received in this process, and the bytes of its flat buffer."""
    got: dict[str, Any] = {}
    reader = threading.Thread(target=lambda: got.update(v=receiver.recv()))
    reader.start()
    sizes: list[int] = []
    send_bytes = sender.conn.send_bytes
    sender.conn.send_bytes = lambda b: (sizes.append(len(b)), send_bytes(b))[1]  # type: ignore[method-assign]
    try:
        sender.send(value)
    finally:
        sender.conn.send_bytes = send_bytes  # type: ignore[method-assign]
    reader.join()
    return got["v"], sizes[1]


@pytest.fixture
def pipe():
    a, b = mp.Pipe()
    yield Sender(a), Receiver(b)
    a.close()
    b.close()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and bool(torch.equal(_bits(a), _bits(b)))
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_every_dtype_and_layout_arrives_bit_for_bit(pipe):
    g = torch.Generator().manual_seed(0)
    nan = torch.tensor([float("nan"), -0.0, float("inf")])
    values = {
        "f32": torch.randn(3, 4, generator=g),
        "f64": torch.randn(5, generator=g, dtype=torch.float64),
        "bf16": torch.randn(4, generator=g).to(torch.bfloat16),
        "i64": torch.arange(7),
        "bool": torch.tensor([True, False, True]),
        "u8": torch.arange(5, dtype=torch.uint8),
        "special": nan,
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(2.5),
        "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "c1_last": torch.empty_strided((6, 1, 4, 4), (16, 1, 4, 1)).normal_(generator=g),
    }
    got, _ = _through(*pipe, values)
    for k, v in values.items():
        assert _same(v, got[k]), k
    assert got["c1_last"].stride() == values["c1_last"].stride() == (16, 1, 4, 1)


def test_a_slice_arrives_dense_with_its_values(pipe):
    big = torch.arange(40.0).reshape(5, 8)
    got, nbytes = _through(*pipe, {"cols": big[:, 2:4], "rows": big[1:3]})
    assert torch.equal(got["cols"], big[:, 2:4]) and got["cols"].is_contiguous()
    assert torch.equal(got["rows"], big[1:3])
    assert nbytes <= 64 + 10 * 4 + 16 * 4  # the slices' bytes, not the whole tensor's


def test_a_tensor_repeated_in_an_exchange_travels_once(pipe):
    sender, receiver = pipe
    w = torch.randn(1000)
    got, first = _through(sender, receiver, [{"w": w}, {"w": w}])
    assert first == 4000 and got[0]["w"] is got[1]["w"]
    again, second = _through(sender, receiver, {"w": w, "new": torch.ones(2)})
    assert second == 8 and torch.equal(again["w"], w)  # the same exchange: w is known
    sender.reset()
    receiver.reset()
    _, after_reset = _through(sender, receiver, {"w": w})
    assert after_reset == 4000


def test_views_of_the_shared_block_travel_as_references():
    data = {
        "x": torch.randn(100, 3, 4).to(memory_format=torch.contiguous_format),
        "y": torch.arange(100),
    }
    block, placed = SharedBuffer.place(data)
    assert all(torch.equal(placed[k], data[k]) for k in data)
    assert placed["x"].untyped_storage().data_ptr() == block.block.untyped_storage().data_ptr()
    a, b = mp.Pipe()
    got, nbytes = _through(Sender(a, block), Receiver(b, block), (placed["x"][10:20], placed["y"]))
    assert nbytes == 0
    assert torch.equal(got[0], data["x"][10:20]) and torch.equal(got[1], data["y"])


def test_a_modules_parameters_stay_parameters(pipe):
    model = nn.Linear(3, 2)
    got, _ = _through(*pipe, model)
    assert isinstance(got.weight, nn.Parameter) and got.weight.requires_grad
    assert torch.equal(got.weight, model.weight) and torch.equal(got.bias, model.bias)
