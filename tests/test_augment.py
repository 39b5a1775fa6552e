"""Stored pixels standardised per batch, and training augmentation.

The transforms are checked against per-image loops written here from their definitions
(the batched code must draw and apply exactly what the loops do); runs are checked to be
the same whether the images are stored as uint8 or as standardised floats, and augmented
runs to be deterministic per (seed, round, client), independent of the executor, and
resumable.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hetfl.assembly
from hetfl.config import ConfigError, validate
from hetfl.core.augment import (
    Augmentation,
    ResizedCrop,
    _boxes,
    cutout,
    padded_crop,
    random_flip,
    resized_crop,
)
from hetfl.core.pixels import PixelNorm
from hetfl.core.rng import torch_generator
from hetfl.data import Dataset
from hetfl.runner import build_simulation
from hetfl.sim import ProcessExecutor

PIXELS = PixelNorm(mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3))


@pytest.fixture(scope="module")
def pool():
    with ProcessExecutor(2) as executor:
        yield executor


def _images(n: int = 5, c: int = 3, h: int = 6, w: int = 7) -> torch.Tensor:
    return (
        torch.arange(n * c * h * w, dtype=torch.int64)
        .remainder(251)
        .to(torch.uint8)
        .view(n, c, h, w)
    )


def _gen(seed: int = 3) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_pixel_norm_is_per_channel_standardisation():
    x = _images()
    got = PIXELS(x)
    for c in range(3):
        want = (x[:, c].double() / 255 - PIXELS.mean[c]) / PIXELS.std[c]
        assert torch.allclose(got[:, c].double(), want, atol=1e-6)
    assert got.dtype == torch.float32
    stacked = PIXELS(x.unsqueeze(0).expand(2, *x.shape))  # (K, N, C, H, W): the vmap stack
    assert torch.equal(stacked[1], got)
    with pytest.raises(ValueError, match="one mean and one std per channel"):
        PixelNorm((0.5, 0.5), (0.2,))
    with pytest.raises(ValueError, match="> 0"):
        PixelNorm((0.5,), (0.0,))


def test_padded_crop_equals_padding_then_slicing_each_image():
    x, p = _images(), 2
    got = padded_crop(x, p, _gen())
    offsets = torch.randint(0, 2 * p + 1, (2, x.shape[0]), generator=_gen())
    for i in range(x.shape[0]):
        padded = F.pad(x[i], (p, p, p, p))
        top, left = int(offsets[0, i]), int(offsets[1, i])
        assert torch.equal(got[i], padded[:, top : top + x.shape[2], left : left + x.shape[3]])
    assert got.dtype == torch.uint8 and (got == 0).any()  # black padding shows somewhere


def test_flip_mirrors_the_images_whose_draw_is_below_a_half():
    x = _images(n=40)
    got = random_flip(x, _gen())
    flipped = torch.rand(40, generator=_gen()) < 0.5
    for i in range(40):
        assert torch.equal(got[i], x[i].flip(2) if flipped[i] else x[i])
    assert 0 < int(flipped.sum()) < 40


def test_cutout_zeroes_a_square_clipped_at_the_borders():
    x = torch.ones(30, 2, 9, 9)
    size = 4
    got = cutout(x, size, _gen())
    g = _gen()
    cy = torch.randint(0, 9, (30,), generator=g)
    cx = torch.randint(0, 9, (30,), generator=g)
    for i in range(30):
        want = torch.ones(2, 9, 9)
        top, left = int(cy[i]) - size // 2, int(cx[i]) - size // 2
        want[:, max(top, 0) : max(top + size, 0), max(left, 0) : max(left + size, 0)] = 0
        assert torch.equal(got[i], want)


def test_resized_crop_of_the_whole_image_is_the_identity():
    x = _images().float()
    whole = ResizedCrop(scale=(1.0, 1.0), ratio=(7 / 6, 7 / 6))  # 6 high, 7 wide: the whole
    assert torch.allclose(resized_crop(x, whole, _gen()), x, atol=1e-3)


def test_resized_crop_boxes_follow_torchvisions_distribution():
    box = ResizedCrop()
    w, h = _boxes(4000, 32, 32, box, _gen(), torch.device("cpu"))
    area, ratio = w * h, w / h
    assert bool((area <= 1).all()) and float(area.min()) >= 0.08 - 2 / 32  # pixel rounding
    assert float(ratio.min()) > 0.6 and float(ratio.max()) < 1.6
    assert 0.45 < float(area.mean()) < 0.6  # the mean of U(0.08, 1), less the boxes that fit
    # A ratio no box can meet in ten tries falls back to the centre crop of that ratio.
    fw, fh = _boxes(3, 10, 40, ResizedCrop(scale=(1, 1), ratio=(1, 1)), _gen(), "cpu")
    assert fw.tolist() == [0.25] * 3 and fh.tolist() == [1.0] * 3  # 10x10 of a 10x40 image


def test_augmentation_order_pads_black_then_standardises_then_cuts_out():
    x = torch.full((8, 3, 5, 5), 200, dtype=torch.uint8)
    aug = Augmentation(crop_padding=3, cutout=2)
    out = aug(x, _gen(), PIXELS)
    black = torch.tensor([(-m / s) for m, s in zip(PIXELS.mean, PIXELS.std, strict=True)])
    per_pixel = out.permute(0, 2, 3, 1).reshape(-1, 3)
    kinds = {tuple(round(v, 4) for v in row.tolist()) for row in per_pixel}
    assert tuple(round(v, 4) for v in black.tolist()) in kinds  # padding: black, standardised
    assert (0.0, 0.0, 0.0) in kinds  # Cutout after standardising: the mean colour
    with pytest.raises(ValueError, match=r"images \(N, C, H, W\)"):
        aug(torch.zeros(4, 10), _gen(), None)


# -- runs ------------------------------------------------------------------------------------
def _uint8_dataset() -> Dataset:
    """Three classes of 3x8x8 images whose colour depends on the class."""
    rng = np.random.default_rng(0)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = np.arange(n, dtype=np.int64) % 3
        base = np.array([[60, 120, 200], [200, 60, 120], [120, 200, 60]])[y]
        noise = rng.integers(-50, 50, (n, 3, 8, 8))
        return np.clip(base[:, :, None, None] + noise, 0, 255).astype(np.uint8), y

    x_train, y_train = draw(240)
    x_test, y_test = draw(90)
    return Dataset("tiny-rgb", x_train, y_train, x_test, y_test, 3, pixels=PIXELS)


def _as_floats(ds: Dataset) -> Dataset:
    def std(x: np.ndarray) -> np.ndarray:
        return PIXELS(torch.from_numpy(x.copy())).numpy()

    return Dataset("tiny-rgb", std(ds.x_train), ds.y_train, std(ds.x_test), ds.y_test, 3)


def _config(**data: object) -> dict:
    return {
        "algorithm": "heterofl",  # static BN: a statistics pass over clients' pixels
        "model": {"name": "stage-cnn", "stages": 2},
        "data": {"dataset": "digits", "num_clients": 4, "test_per_client": 10, **data},
        "train": {"rounds": 2, "clients_per_round": 3, "batch_size": 16, "lr": 0.05},
        "eval": {"local_eval": "all"},
        "options": {"heterofl": {"assignment": "dynamic"}},
        "threads": 1,
        "checkpoint_every": 1,
        "device": "cpu",
    }


def _run(monkeypatch, dataset: Dataset, run_dir: Path, raw: dict, executor=None, resume=False):
    monkeypatch.setattr(hetfl.assembly, "load_dataset", lambda cfg: dataset)
    sim = build_simulation(validate(raw), run_dir, show_progress=False)
    if executor is not None:
        sim.executor = executor
    sim.run(resume=resume)
    rows = [
        {k: v for k, v in json.loads(line).items() if k != "wall_time_s"}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    return rows, {k: v.clone() for k, v in sim.state.items()}


def _same(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_uint8_pixels_standardised_per_batch_train_exactly_as_standardised_floats(
    monkeypatch, tmp_path, pool
):
    """Training, global and local evaluation and the statistics pass all see the same
    floats, in process and in worker processes."""
    pixels = _uint8_dataset()
    floats = _run(monkeypatch, _as_floats(pixels), tmp_path / "f", _config())
    stored = _run(monkeypatch, pixels, tmp_path / "u", _config(), pool)
    assert _same(floats, stored)
    assert stored[0][-1]["global_acc"] > 0.5  # colours tell the classes apart


def test_augmented_runs_are_deterministic_executor_independent_and_resumable(
    monkeypatch, tmp_path, pool
):
    ds = _uint8_dataset()
    raw = _config(augment={"crop_padding": 2, "flip": True, "resized_crop": True, "cutout": 3})
    plain = _run(monkeypatch, ds, tmp_path / "plain", _config())
    first = _run(monkeypatch, ds, tmp_path / "a", raw)
    again = _run(monkeypatch, ds, tmp_path / "b", raw, pool)
    assert _same(first, again) and not _same(first, plain)
    one = {**raw, "train": {**raw["train"], "rounds": 1}}
    _run(monkeypatch, ds, tmp_path / "c", one)
    resumed = _run(monkeypatch, ds, tmp_path / "c", raw, resume=True)
    assert _same(first, resumed)


def test_clients_draw_their_own_augmentation():
    x = _images(n=16, h=8, w=8)
    aug = Augmentation(crop_padding=2, flip=True)
    one = aug(x, torch_generator(0, 1, 0, "augment"), PIXELS)
    same = aug(x, torch_generator(0, 1, 0, "augment"), PIXELS)
    other = aug(x, torch_generator(0, 1, 1, "augment"), PIXELS)
    later = aug(x, torch_generator(0, 2, 0, "augment"), PIXELS)
    assert torch.equal(one, same) and not torch.equal(one, other)
    assert not torch.equal(one, later)


def test_augment_settings_are_checked_at_the_edge():
    with pytest.raises(ConfigError, match="crop_padding"):
        validate(_config(augment={"crop_padding": -1}))
    with pytest.raises(ConfigError, match="scale must satisfy"):
        validate(_config(augment={"resized_crop": {"scale": [0.5, 0.2]}}))
    with pytest.raises(ConfigError, match="cutuot"):
        validate(_config(augment={"cutuot": 4}))
    cfg = validate(_config(augment={"resized_crop": True}))
    assert cfg.data.augment is not None
    box = cfg.data.augment.augmentation().resized_crop
    assert box is not None and box.scale == (0.08, 1.0)
    assert math.isclose(box.ratio[1], 4 / 3)


def test_augmenting_non_images_is_refused(tmp_path):
    raw = {
        **_config(augment={"flip": True}),
        "data": {"dataset": "synthetic", "num_clients": 4, "augment": {"flip": True}},
    }
    raw["model"] = {"name": "mlp"}
    raw["algorithm"] = "fedavg"
    raw.pop("options")
    tabular = Dataset(
        "tab",
        np.zeros((40, 5), np.float32),
        np.arange(40) % 2,
        np.zeros((10, 5), np.float32),
        np.arange(10) % 2,
        2,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hetfl.assembly, "load_dataset", lambda cfg: tabular)
        with pytest.raises(ValueError, match=r"data\.augment transforms images"):
            build_simulation(validate(raw), tmp_path, show_progress=False)
