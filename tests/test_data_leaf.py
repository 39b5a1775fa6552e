"""LEAF's FEMNIST and Shakespeare on tiny folders in LEAF's exact layout, the natural
partition, and char-lstm trained end to end."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hetfl.assembly import partition
from hetfl.cli import main
from hetfl.config import ConfigError, validate
from hetfl.core.types import PassRecord
from hetfl.data import PARTITIONERS, DatasetNotFoundError, PartitionError
from hetfl.data.leaf import (
    SHAKESPEARE_VOCABULARY,
    cache_path,
    encode_characters,
    load_femnist,
    load_shakespeare,
)
from hetfl.models import PlainFamily
from hetfl.runner import build_simulation
from hetfl.systems.costs import MacCounter

# --- LEAF folders, written as LEAF's split_data.py writes them ------------------------------


def _leaf_file(users: dict[str, tuple[list[Any], list[Any]]]) -> dict[str, Any]:
    return {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }


def _write_leaf(root: Path, train: list[dict], test: list[dict]) -> Path:
    """`train`/`test`: one {user: (x, y)} per JSON file, named as LEAF names them."""
    for split, files in (("train", train), ("test", test)):
        (root / split).mkdir(parents=True, exist_ok=True)
        for i, users in enumerate(files):
            path = root / split / f"all_data_{i}_niid_05_keep_0_{split}_9.json"
            path.write_text(json.dumps(_leaf_file(users)))
    return root


def _images(rng: np.random.Generator, n: int) -> tuple[np.ndarray, list[list[float]]]:
    """n images as pixels, and as LEAF writes them: each pixel / 255 as a float."""
    pixels = rng.integers(0, 256, (n, 784))
    return pixels, (pixels / 255).tolist()


#: FEMNIST writers (deliberately not in sorted order within and across files) and their
#: training/test sample counts.
WRITERS = {"f0002_10": (3, 1), "f0000_01": (2, 2), "f0001_05": (4, 1)}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HETFL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def femnist(tmp_path, cache) -> tuple[Path, dict[str, dict[str, tuple[np.ndarray, list]]]]:
    """A FEMNIST folder (two training files) and each writer's pixels and labels."""
    rng = np.random.default_rng(0)
    truth: dict[str, dict[str, tuple[np.ndarray, list]]] = {"train": {}, "test": {}}
    for writer, counts in WRITERS.items():
        for split, n in zip(("train", "test"), counts, strict=True):
            truth[split][writer] = (rng.integers(0, 256, (n, 784)), rng.integers(0, 62, n).tolist())
    truth["train"]["f0002_10"][1][0] = 61  # the last class appears

    def as_leaf(split: str, writers: list[str]) -> dict:
        return {w: ((truth[split][w][0] / 255).tolist(), truth[split][w][1]) for w in writers}

    root = _write_leaf(
        tmp_path / "femnist",
        train=[as_leaf("train", ["f0002_10", "f0000_01"]), as_leaf("train", ["f0001_05"])],
        test=[as_leaf("test", list(WRITERS))],
    )
    return root, truth


def test_femnist_loads_uint8_images_labels_and_writers_in_sorted_id_order(femnist):
    root, truth = femnist
    ds = load_femnist(root)
    order = sorted(WRITERS)  # f0000_01, f0001_05, f0002_10
    assert ds.x_train.dtype == np.uint8 and ds.x_train.shape == (9, 1, 28, 28)
    assert ds.x_test.shape == (4, 1, 28, 28) and ds.num_classes == 62
    expected_x = np.concatenate([truth["train"][w][0] for w in order]).reshape(-1, 1, 28, 28)
    assert np.array_equal(ds.x_train, expected_x)  # LEAF's k / 255 floats back to k
    expected_y = [label for w in order for label in truth["train"][w][1]]
    assert ds.y_train.dtype == np.int64 and ds.y_train.tolist() == expected_y
    assert np.array_equal(
        np.bincount(ds.y_train, minlength=62), np.bincount(expected_y, minlength=62)
    )
    assert ds.train_groups.tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 2] and ds.num_groups == 3
    test_y = [label for w in order for label in truth["test"][w][1]]
    assert ds.y_test.tolist() == test_y
    pixels = expected_x / 255.0
    assert ds.pixels.mean == pytest.approx((pixels.mean(),), abs=1e-12)
    assert ds.pixels.std == pytest.approx((pixels.std(),), abs=1e-12)


def test_a_second_load_reads_the_cache_and_a_changed_file_is_parsed_again(
    femnist, cache, monkeypatch
):
    root, _ = femnist
    first = load_femnist(root)
    assert [p.name for p in cache_path("femnist", root).parent.iterdir()] == [
        cache_path("femnist", root).name
    ]  # one cache file, no temporary left behind

    def no_parsing(*args, **kwargs):
        raise AssertionError("json.load called")

    monkeypatch.setattr(json, "load", no_parsing)
    again = load_femnist(root)
    for name in ("x_train", "y_train", "x_test", "y_test", "train_groups"):
        assert np.array_equal(getattr(first, name), getattr(again, name))
    assert again.pixels == first.pixels
    changed = next((root / "test").iterdir())
    os.utime(changed, ns=(0, changed.stat().st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match=r"json\.load called"):
        load_femnist(root)


def _shakespeare_user(text: str) -> tuple[list[str], list[str]]:
    """LEAF's samples of one speaker: every 80-character window and the character after."""
    return [text[i : i + 80] for i in range(len(text) - 80)], list(text[80:])


LINES = {
    "THE_TEMPEST_ARIEL": "All hail, great master! grave sir, hail! I come " * 3,
    "HAMLET_HAMLET": "To be, or not to be: that is the question.\n" * 3,
}


def _speakers(root: Path, lines: dict[str, str]) -> Path:
    return _write_leaf(
        root,
        train=[{u: _shakespeare_user(t) for u, t in lines.items()}],
        test=[{u: _shakespeare_user(t[::-1]) for u, t in lines.items()}],
    )


@pytest.fixture
def shakespeare(tmp_path, cache) -> Path:
    return _speakers(tmp_path / "shakespeare", LINES)


@pytest.fixture
def chorus(tmp_path, cache) -> Path:
    """Two speakers of few characters: a loss that a few SGD steps visibly lower."""
    return _speakers(
        tmp_path / "chorus", {"CHORUS_A": "la la la! " * 12, "CHORUS_B": "lo, la. " * 14}
    )


def test_the_vocabulary_is_leafs_80_characters_in_order():
    assert len(SHAKESPEARE_VOCABULARY) == 80
    # By hand: \n=0, space=1, ','=8, 'A'..'Z'=25..50, 'a'..'z'=53..78, '}'=79.
    assert encode_characters("To be,\n}", "here").tolist() == [44, 67, 1, 54, 57, 8, 0, 79]


def test_shakespeare_loads_int64_codes_next_characters_and_speakers(shakespeare):
    ds = load_shakespeare(shakespeare)
    hamlet, ariel = (_shakespeare_user(LINES[u]) for u in ("HAMLET_HAMLET", "THE_TEMPEST_ARIEL"))
    n_hamlet, n_ariel = len(hamlet[1]), len(ariel[1])
    assert ds.x_train.dtype == np.int64 and ds.x_train.shape == (n_hamlet + n_ariel, 80)
    assert ds.num_classes == 80 and ds.input_shape == (80,) and ds.pixels is None
    decode = np.array(list(SHAKESPEARE_VOCABULARY))
    assert "".join(decode[ds.x_train[0]]) == hamlet[0][0]  # HAMLET_HAMLET sorts first
    assert "".join(decode[ds.y_train[:n_hamlet]]) == "".join(hamlet[1])
    assert ds.train_groups.tolist() == [0] * n_hamlet + [1] * n_ariel
    assert ds.x_test.shape == ds.x_train.shape and ds.y_test.dtype == np.int64


# --- bad files -------------------------------------------------------------------------------


def _corrupt(root: Path, change) -> Path:
    path = sorted((root / "train").iterdir())[0]
    data = json.loads(path.read_text())
    change(data)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _first(data: dict) -> dict:
    return data["user_data"][data["users"][0]]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("num_samples"), "missing key 'num_samples'"),
        (lambda d: d["num_samples"].__setitem__(0, 7), "num_samples says 7 but x has 3"),
        (lambda d: d["user_data"].pop("f0000_01"), "without data: \\['f0000_01'\\]"),
        (lambda d: _first(d)["x"][0].pop(), "each x must be 784 pixel values"),
        (lambda d: _first(d)["x"][1].__setitem__(5, 1.5), "sample 1 has pixel values that"),
        (lambda d: _first(d)["x"][0].__setitem__(0, 1), "sample 0 has pixel values that"),
        (lambda d: _first(d)["y"].__setitem__(2, 62), "label 62 \\(sample 2\\) is not an"),
    ],
)
def test_a_bad_femnist_file_is_named_with_the_fault(femnist, change, message):
    root, _ = femnist
    path = _corrupt(root, change)
    with pytest.raises(ValueError, match=message) as err:
        load_femnist(root)
    assert str(path) in str(err.value)


def test_a_file_that_is_not_json_names_the_layout(femnist):
    root, _ = femnist
    path = sorted((root / "train").iterdir())[0]
    path.write_text('{"users": [')
    with pytest.raises(ValueError, match="not valid JSON") as err:
        load_femnist(root)
    assert str(path) in str(err.value) and '"user_data": {id: {"x"' in str(err.value)


def test_a_writer_in_two_training_files_is_an_error(femnist):
    root, _ = femnist
    files = sorted((root / "train").iterdir())
    files[1].write_text(files[0].read_text())
    with pytest.raises(ValueError, match=r"user 'f0002_10' is also in .*train_9\.json"):
        load_femnist(root)


def test_a_test_user_without_training_samples_asks_for_the_split_by_sample(tmp_path, cache):
    rng = np.random.default_rng(0)
    _, a = _images(rng, 2)
    _, b = _images(rng, 1)
    root = _write_leaf(
        tmp_path / "femnist", train=[{"f0000_01": (a, [0, 1])}], test=[{"f0009_00": (b, [3])}]
    )
    with pytest.raises(ValueError, match=r"user 'f0009_00' .* -t sample"):
        load_femnist(root)


def test_a_character_outside_the_vocabulary_names_file_and_user(shakespeare):
    path = _corrupt(shakespeare, lambda d: d["user_data"]["HAMLET_HAMLET"]["y"].__setitem__(3, "~"))
    with pytest.raises(ValueError, match="user 'HAMLET_HAMLET': character '~' is not in") as e:
        load_shakespeare(shakespeare)
    assert str(path) in str(e.value)


def test_missing_leaf_data_says_how_to_generate_it(tmp_path, capsys):
    with pytest.raises(DatasetNotFoundError, match=r"-s niid --sf 0\.05 -k 0 -t sample"):
        load_femnist(tmp_path / "nothing")
    assert main(["data", "download", "shakespeare"]) == 2
    err = capsys.readouterr().err
    assert "LEAF publishes no shakespeare files" in err
    assert "./preprocess.sh -s niid --sf 0.2 -k 0 -t sample --tf 0.8" in err


# --- the natural partition -------------------------------------------------------------------

OWNERS = np.array([4, 0, 2, 4, 1, 5, 0, 3, 2, 4, 5, 1, 3, 0], dtype=np.int64)  # 6 owners
LABELS = np.zeros(OWNERS.size, dtype=np.int64)


def _natural(num_clients: int, seed: int, groups: np.ndarray | None = OWNERS) -> list:
    return PARTITIONERS.get("natural")(
        LABELS, num_clients, np.random.default_rng(seed), groups=groups
    )


def test_natural_gives_each_client_one_owner():
    parts = _natural(6, seed=0)
    assert [p.tolist() for p in parts] == [
        np.flatnonzero(np.equal(OWNERS, owner)).tolist() for owner in range(6)
    ]


def test_natural_with_fewer_clients_deals_a_seeded_sample_of_owners():
    def owners(parts):
        held = [np.unique(OWNERS[p]) for p in parts]
        assert all(h.size == 1 for h in held)
        for part, owner in zip(parts, held, strict=True):
            assert np.array_equal(part, np.flatnonzero(np.equal(OWNERS, owner[0])))
        return [int(h[0]) for h in held]

    drawn = {seed: owners(_natural(3, seed)) for seed in range(6)}
    assert all(len(set(o)) == 3 and o == sorted(o) for o in drawn.values())
    assert owners(_natural(3, 0)) == drawn[0]
    assert len({tuple(o) for o in drawn.values()}) > 1


def test_natural_refuses_more_clients_than_owners_and_data_without_owners():
    with pytest.raises(PartitionError, match="num_clients = 7 but the training set has 6 own"):
        _natural(7, seed=0)
    with pytest.raises(
        PartitionError, match="datasets with owners: femnist, pydoc-topics, shakespeare, wikitext2"
    ):
        _natural(2, seed=0, groups=None)
    with pytest.raises(
        ConfigError,
        match="owners \\(femnist, pydoc-topics, shakespeare, wikitext2\\), not 'digits'",
    ):
        validate({"data": {"dataset": "digits", "partition": {"kind": "natural"}}})


# --- char-lstm on Shakespeare, end to end ----------------------------------------------------


def _shakespeare_run(root: Path, tmp_path: Path) -> dict:
    return {
        "seed": 0,
        "device": "cpu",
        "threads": 1,
        "algorithm": "fedavg",
        "output_dir": str(tmp_path / "runs"),
        "data": {
            "dataset": "shakespeare",
            "path": str(root),
            "num_clients": 2,
            "partition": {"kind": "natural"},
            "test_per_client": 8,
        },
        "model": {"name": "char-lstm"},
        "train": {
            "rounds": 2,
            "clients_per_round": 2,
            "local_steps": 3,
            "batch_size": 8,
            "lr": 1.0,
        },
        "eval": {"test_samples": 16},
    }


def test_two_builds_deal_the_same_speakers_as_flower_nodes_do(shakespeare, tmp_path):
    from hetfl.assembly import load_dataset

    cfg = validate(_shakespeare_run(shakespeare, tmp_path))
    dataset = load_dataset(cfg)
    first, second = partition(cfg, dataset), partition(cfg, load_dataset(cfg))
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    assert [np.unique(dataset.train_groups[p]).tolist() for p in first] == [[0], [1]]


def test_char_lstm_trains_on_shakespeare_and_lowers_its_loss(chorus, tmp_path):
    sim = build_simulation(
        validate(_shakespeare_run(chorus, tmp_path)), tmp_path / "run", show_progress=False
    )
    sim.run()
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]  # 4.11 then 2.78: the characters' frequencies learnt
    assert losses[1] < losses[0] - 1.0, losses
    assert all(r["macs"] > 0 for r in rows)


def test_char_lstm_macs_are_counted_by_hand():
    """Forward MACs per sample: per step, LSTM layer l does 4H(I_l + H) (input and hidden
    products), 4*256*(8+256) + 4*256*(256+256) = 794,624, times 80 steps; then the decoder
    256*80. The embedding is a lookup (no MACs)."""
    family = PlainFamily("char-lstm", (80,), 80)
    spec = family.global_spec([])
    forward = MacCounter(family).pass_macs(PassRecord(spec, "forward", 3, 1), (80,))
    assert forward == 3 * (80 * 794_624 + 256 * 80)
    train = MacCounter(family).pass_macs(PassRecord(spec, "train", 3, 1), (80,))
    assert 2.5 * forward < train < 3 * forward  # backward: about twice the forward
    with pytest.raises(ValueError, match="'train\\+input' needs float inputs"):
        MacCounter(family).pass_macs(PassRecord(spec, "train+input", 3, 1), (80,))
    assert torch.backends.mkldnn.enabled  # pricing left oneDNN as it found it


def test_femnist_trains_end_to_end_one_writer_per_client(femnist, tmp_path):
    """uint8 pixels standardised per batch, the natural partition, a run through the
    engine: each client holds exactly its writer's samples."""
    root, _ = femnist
    raw = {
        **_shakespeare_run(root, tmp_path),
        "data": {
            "dataset": "femnist",
            "path": str(root),
            "num_clients": 3,
            "partition": {"kind": "natural"},
            "test_per_client": 0,  # local splits come from the global test set's classes
        },
        "model": {"name": "small-cnn"},
        "train": {"rounds": 1, "clients_per_round": 3, "batch_size": 2, "lr": 0.1},
        "eval": {"local_eval": "none"},
    }
    sim = build_simulation(validate(raw), tmp_path / "fem", show_progress=False)
    assert sorted(c.n_train for c in sim.clients.values()) == [2, 3, 4]  # WRITERS' counts
    assert all(c.x_train.dtype == torch.uint8 for c in sim.clients.values())
    sim.run()
    rows = (tmp_path / "fem" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and json.loads(rows[0])["global_acc"] is not None
