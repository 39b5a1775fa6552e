"""The data layer: sources, partitioners and the clients' tensors."""

from __future__ import annotations

import gc
import gzip
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from hetfl.core.rng import numpy_generator
from hetfl.data import (
    DATASETS,
    PARTITIONERS,
    Dataset,
    DatasetNotFoundError,
    PartitionError,
    build_clients,
    class_counts,
    dirichlet,
    fashion_mnist,
    format_class_table,
    global_test,
    k_classes,
    load_digits,
    load_fashion_mnist,
    load_npz,
    load_synthetic,
    local_test_indices,
    quantity_skew,
    read_idx,
)

BALANCED = np.repeat(np.arange(10, dtype=np.int64), 100)
# Options that make every registered partitioner cover the balanced labels above exactly
# (100 samples per class; k_classes gives each class 2 holders of 50 each; natural gets 10
# owners, each holding every tenth sample, for 10 clients).
PARTITION_OPTIONS = {
    "iid": {},
    "dirichlet": {"alpha": 0.5},
    "classes": {"k": 2},
    "quantity": {"alpha": 2.0},
    "natural": {"groups": np.arange(BALANCED.size, dtype=np.int64) % 10},
}
# With as many clients as owners, `natural` deals every owner whatever the seed; its seeded
# sample of owners is tested in test_data_leaf.py.
SEEDED = sorted(set(PARTITION_OPTIONS) - {"natural"})


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_digits(seed=0)


def _rng(seed: int) -> np.random.Generator:
    return numpy_generator(seed, 0, -1, "partition")


def _partition(name: str, labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    return PARTITIONERS.get(name)(labels, num_clients, _rng(seed), **PARTITION_OPTIONS[name])


# --- partitioners ----------------------------------------------------------------------------


def test_every_partitioner_has_test_options():
    assert set(PARTITIONERS.names()) == set(PARTITION_OPTIONS)


@pytest.mark.parametrize("name", sorted(PARTITION_OPTIONS))
def test_partition_is_a_disjoint_cover_of_sorted_int64_arrays(name):
    parts = _partition(name, BALANCED, 10, seed=0)
    assert len(parts) == 10
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)
    assert sum(p.size for p in parts) == BALANCED.size
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(BALANCED.size))


@pytest.mark.parametrize("name", SEEDED)
def test_partition_reproduces_with_its_seed_and_changes_with_another(name):
    a, b, c = (_partition(name, BALANCED, 10, seed=s) for s in (3, 3, 4))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("name", sorted(PARTITION_OPTIONS))
def test_more_clients_than_samples_names_both_numbers(name):
    with pytest.raises(PartitionError, match="more clients than samples") as err:
        _partition(name, BALANCED[:30], 31, seed=0)
    assert "31" in str(err.value) and "30" in str(err.value)
    with pytest.raises(PartitionError, match="at least 1"):
        _partition(name, BALANCED, 0, seed=0)


def test_dirichlet_skew_grows_as_alpha_falls(digits):
    def mean_max_fraction(alpha: float) -> float:
        parts = dirichlet(digits.y_train, 10, _rng(0), alpha=alpha, min_size=10)
        counts = class_counts(digits.y_train, parts, 10)
        return float((counts.max(axis=1) / counts.sum(axis=1)).mean())

    skewed, mild = mean_max_fraction(0.1), mean_max_fraction(10.0)
    assert skewed > 0.6 > 0.25 > mild  # IID would be ~0.1 per class plus noise


def test_dirichlet_stops_feeding_clients_past_an_equal_share(digits):
    y = digits.y_train
    cap = y.size / 5 + np.bincount(y).max()  # at most one class lands on a full client
    for seed in range(5):
        parts = dirichlet(y, 5, _rng(seed), alpha=0.05, min_size=0)
        assert max(p.size for p in parts) < cap


def test_dirichlet_guarantees_min_size(digits):
    parts = dirichlet(digits.y_train, 20, _rng(1), alpha=0.3, min_size=20)
    assert min(p.size for p in parts) >= 20


def test_dirichlet_that_keeps_failing_names_alpha_and_min_size(digits):
    with pytest.raises(PartitionError) as err:
        dirichlet(digits.y_train, 20, _rng(0), alpha=0.01, min_size=70, max_retries=3)
    message = str(err.value)
    assert "alpha = 0.01" in message and "min_size = 70" in message
    assert "num_clients = 20" in message and "larger alpha" in message


@pytest.mark.parametrize("partitioner", [dirichlet, quantity_skew])
def test_min_size_beyond_the_data_is_rejected_before_drawing(partitioner):
    with pytest.raises(PartitionError, match="min_size = 101") as err:
        partitioner(BALANCED, 10, _rng(0), alpha=1.0, min_size=101)
    assert "1000 samples" in str(err.value)


def test_quantity_skew_keeps_labels_iid_and_sizes_unequal():
    parts = quantity_skew(BALANCED, 10, _rng(0), alpha=1.0, min_size=20)
    sizes = np.array([p.size for p in parts])
    assert sizes.min() >= 20 and sizes.max() > 2 * sizes.min()
    counts = class_counts(BALANCED, parts, 10)
    assert (counts > 0).sum(axis=1).min() >= 8  # every client sees (almost) every class
    with pytest.raises(PartitionError, match=r"alpha = 0\.05.*min_size = 90"):
        quantity_skew(BALANCED, 10, _rng(0), alpha=0.05, min_size=90, max_retries=3)


def test_iid_half_to_full_sizes_follow_their_weights_within_half_of_the_largest():
    """FedFA's IID setting: every client's size is n u_i / sum(u) up to one sample, u_i
    drawn uniformly in [1/2, 1] from the partition generator before the permutation; so
    the smallest client holds at least half the largest's samples (up to rounding), the
    parts are a disjoint cover, and the labels stay IID."""
    iid = PARTITIONERS.get("iid")
    for seed in range(5):
        parts = iid(BALANCED, 10, _rng(seed), sizes="half-to-full")
        weights = _rng(seed).uniform(0.5, 1.0, size=10)
        sizes = np.array([p.size for p in parts])
        assert np.all(np.abs(sizes - 1000 * weights / weights.sum()) <= 1)
        assert sizes.min() >= sizes.max() / 2 - 1 and len(set(sizes)) > 1
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(1000))
        assert (class_counts(BALANCED, parts, 10) > 0).all()
    equal = iid(BALANCED, 10, _rng(0))
    assert [p.size for p in equal] == [100] * 10  # the default is unchanged
    with pytest.raises(PartitionError, match="sizes must be one of equal, half-to-full"):
        iid(BALANCED, 10, _rng(0), sizes="skewed")


def test_iid_sizes_apply_to_iid_only_in_the_config():
    from hetfl.config import ConfigError, validate

    cfg = validate({"data": {"partition": {"kind": "iid", "sizes": "half-to-full"}}})
    assert cfg.data.partition.arguments() == {"sizes": "half-to-full"}
    with pytest.raises(ConfigError, match="sizes = 'half-to-full' applies to kind 'iid' only"):
        validate({"data": {"partition": {"kind": "quantity", "sizes": "half-to-full"}}})


def test_k_classes_gives_each_client_k_classes_in_equal_shares():
    labels = np.repeat(np.arange(10, dtype=np.int64), 60)
    parts = k_classes(labels, 20, _rng(0), k=3)  # 60 shards over 10 classes: 6 holders each
    counts = class_counts(labels, parts, 10)
    assert ((counts > 0).sum(axis=1) == 3).all()
    assert set(np.unique(counts)) == {0, 10}  # 60 samples / 6 holders, per held class
    other = class_counts(labels, k_classes(labels, 20, _rng(1), k=3), 10)
    assert not np.array_equal(counts > 0, other > 0)  # the class order is shuffled


def test_k_classes_drops_only_what_does_not_divide(digits):
    y = digits.y_train
    parts = k_classes(y, 7, _rng(0), k=3)  # 21 shards over 10 classes: 2 or 3 holders
    counts = class_counts(y, parts, 10)
    holders = (counts > 0).sum(axis=0)
    for c in range(10):
        held = counts[:, c][counts[:, c] > 0]
        assert held.min() == held.max()  # equal shares of the class
        assert 0 <= np.sum(y == c) - held.sum() < holders[c]  # the remainder is dropped
    assert len(np.unique(np.concatenate(parts))) == sum(p.size for p in parts)


def _held(labels: np.ndarray, parts: list[np.ndarray], classes: int) -> list[frozenset[int]]:
    counts = class_counts(labels, parts, classes)
    return [frozenset(np.flatnonzero(row).tolist()) for row in counts]


def test_k_classes_least_used_deal_follows_the_authors_rule_by_hand():
    """FLANC's code deals each client's classes one at a time among the classes dealt least
    often so far. With 4 classes and k = 3: client 0 takes 3 classes, so the class it left
    is the only least-used one and client 1 must take it; by the end every class has
    4 * 3 / 4 = 3 holders. With 2 clients and k = 2, the second takes what the first left."""
    labels = np.repeat(np.arange(4, dtype=np.int64), 60)
    for seed in range(5):
        held = _held(labels, k_classes(labels, 4, _rng(seed), k=3, deal="least-used"), 4)
        assert all(len(h) == 3 for h in held)
        (left,) = set(range(4)) - held[0]
        assert left in held[1], (seed, held)
        assert [sum(c in h for h in held) for c in range(4)] == [3, 3, 3, 3]
    for seed in range(5):
        first, second = _held(labels, k_classes(labels, 2, _rng(seed), k=2, deal="least-used"), 4)
        assert first | second == set(range(4)) and not first & second


def test_k_classes_least_used_gives_many_class_sets_where_round_robin_gives_ten():
    """100 clients with 3 of 10 classes (issue: round-robin gives only 10 distinct label
    triples); least-used keeps 30 holders per class and draws far more distinct triples."""
    labels = np.repeat(np.arange(10, dtype=np.int64), 300)
    robin = _held(labels, k_classes(labels, 100, _rng(0), k=3), 10)
    least = _held(labels, k_classes(labels, 100, _rng(0), k=3, deal="least-used"), 10)
    assert len(set(robin)) == 10
    assert len(set(least)) > 40
    assert all(len(h) == 3 for h in least)
    assert [sum(c in h for h in least) for c in range(10)] == [30] * 10
    with pytest.raises(PartitionError, match=r"deal must be one of round-robin, least-used, got"):
        k_classes(labels, 10, _rng(0), k=3, deal="random")


@pytest.mark.parametrize(
    ("k", "num_clients", "match"),
    [(11, 5, "k = 11"), (0, 5, "k = 0"), (10, 5, "class 0 has 2 samples for 5 clients")],
)
def test_k_classes_rejects_impossible_settings(k, num_clients, match):
    labels = np.concatenate([[0, 0], BALANCED[BALANCED > 0]])  # class 0 is nearly empty
    with pytest.raises(PartitionError, match=match):
        k_classes(labels, num_clients, _rng(0), k=k)


def test_class_table_has_class_header_and_totals():
    counts = np.array([[3, 0, 12], [1, 5, 0]])
    lines = format_class_table(counts).splitlines()
    assert lines[0].split() == ["client", "0", "1", "2", "total"]
    assert lines[1].split() == ["0", "3", "0", "12", "15"]
    assert lines[-1].split() == ["total", "4", "5", "12", "21"]


# --- local test splits and client tensors ----------------------------------------------------


def test_local_test_split_follows_class_proportions_without_replacement():
    test_labels = np.repeat(np.arange(10, dtype=np.int64), 50)
    train_labels = np.array([2] * 60 + [5] * 30 + [7] * 10, dtype=np.int64)
    idx = local_test_indices(train_labels, test_labels, 33, np.random.default_rng(0))
    assert idx.size == 33 and np.unique(idx).size == 33
    # quotas 19.8, 9.9, 3.3 -> 19, 9, 3 plus the two largest remainders
    assert np.bincount(test_labels[idx], minlength=10).tolist() == [
        0, 0, 20, 0, 0, 10, 0, 3, 0, 0,
    ]  # fmt: skip


def test_local_test_split_fills_a_short_class_from_the_others():
    test_labels = np.array([0] * 3 + [1] * 40 + [2] * 40, dtype=np.int64)
    train_labels = np.array([0] * 50 + [1] * 50, dtype=np.int64)  # class 2 not held
    idx = local_test_indices(train_labels, test_labels, 20, np.random.default_rng(0))
    assert np.bincount(test_labels[idx], minlength=3).tolist() == [3, 17, 0]
    everything = local_test_indices(train_labels, test_labels, 60, np.random.default_rng(0))
    assert np.array_equal(everything, np.arange(43))  # all 43 samples of classes 0 and 1


def test_build_clients_tensors_and_local_test_classes(digits):
    parts = dirichlet(digits.y_train, 8, _rng(0), alpha=0.3)
    clients = build_clients(digits, parts, test_per_client=40, seed=0)
    again = build_clients(digits, parts, test_per_client=40, seed=0)
    for cid, (client, part) in enumerate(zip(clients, parts, strict=True)):
        assert client.cid == cid and client.num_classes == 10
        assert client.x_train.dtype == torch.float32 and client.y_train.dtype == torch.int64
        assert torch.equal(client.x_train, torch.from_numpy(digits.x_train[part]))
        assert client.x_test.shape == (40, 1, 8, 8)
        assert set(client.y_test.tolist()) <= set(client.labels)
        assert torch.unique(client.x_test.flatten(1), dim=0).shape[0] == 40  # no repeats
        assert torch.equal(client.x_test, again[cid].x_test)
    other_seed = build_clients(digits, parts, test_per_client=40, seed=1)
    assert not torch.equal(clients[0].x_test, other_seed[0].x_test)


def test_zero_test_per_client_gives_empty_tensors_and_global_test_is_whole(digits):
    client = build_clients(digits, [np.arange(50)], test_per_client=0, seed=0)[0]
    assert client.x_test.shape == (0, 1, 8, 8) and client.y_test.dtype == torch.int64
    x, y = global_test(digits)
    assert x.shape == (digits.y_test.size, 1, 8, 8) and torch.equal(
        y, torch.from_numpy(digits.y_test)
    )


# --- sources ---------------------------------------------------------------------------------


def test_loaders_leave_the_global_generators_alone(digits):
    np_state, torch_state = np.random.get_state()[1].copy(), torch.random.get_rng_state()
    load_digits(seed=1)
    load_synthetic(n_train=100, n_test=20, seed=1)
    for name in PARTITION_OPTIONS:
        _partition(name, BALANCED, 10, seed=0)
    build_clients(digits, [np.arange(100)], test_per_client=10, seed=0)
    assert np.array_equal(np.random.get_state()[1], np_state)
    assert torch.equal(torch.random.get_rng_state(), torch_state)


def test_registry_lists_every_source():
    assert {"fashion-mnist", "digits", "synthetic", "npz"} <= set(DATASETS.names())


def test_digits_split_is_stratified_and_seeded(digits):
    assert digits.input_shape == (1, 8, 8) and digits.num_classes == 10
    assert digits.y_train.size + digits.y_test.size == 1797
    assert digits.x_train.min() >= 0.0 and digits.x_train.max() <= 1.0
    fraction = np.bincount(digits.y_test) / np.bincount(
        np.concatenate([digits.y_train, digits.y_test])
    )
    assert np.all(np.abs(fraction - 0.2) < 0.01)
    assert not np.array_equal(load_digits(seed=1).y_test, digits.y_test)


def test_synthetic_is_seeded_and_learnable():
    ds = load_synthetic(n_train=600, n_test=300, num_classes=10, shape=(1, 8, 8), seed=0)
    same = load_synthetic(n_train=600, n_test=300, num_classes=10, shape=(1, 8, 8), seed=0)
    assert np.array_equal(ds.x_train, same.x_train)
    assert not np.array_equal(ds.x_train, load_synthetic(n_train=600, n_test=300, seed=1).x_train)
    assert np.bincount(ds.y_train).tolist() == [60] * 10
    x, y = torch.from_numpy(ds.x_train).flatten(1), torch.from_numpy(ds.y_train)
    weight = torch.zeros(64, 10, requires_grad=True)  # softmax regression from zero
    opt = torch.optim.SGD([weight], lr=0.1)
    for _ in range(20):  # full-batch steps
        opt.zero_grad()
        torch.nn.functional.cross_entropy(x @ weight, y).backward()
        opt.step()
    pred = (torch.from_numpy(ds.x_test).flatten(1) @ weight).argmax(1).numpy()
    assert (pred == ds.y_test).mean() > 0.5  # chance is 0.1


def test_npz_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.random((20, 5)),
        "y_train": np.arange(20) % 4,
        "x_test": rng.random((6, 5)),
        "y_test": np.arange(6) % 3,
    }
    np.savez(tmp_path / "mine.npz", **arrays)
    ds = load_npz(str(tmp_path / "mine.npz"))
    assert ds.num_classes == 4 and ds.input_shape == (5,)
    assert ds.x_train.dtype == np.float32 and ds.y_test.dtype == np.int64
    assert np.allclose(ds.x_test, arrays["x_test"]) and np.array_equal(
        ds.y_train, arrays["y_train"]
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"y_test": None}, "missing array 'y_test'"),
        ({"y_train": np.linspace(0, 3, 20)}, "y_train must be a 1-d integer array"),
        ({"y_train": np.arange(20) - 1}, "label -1"),
        ({"x_test": np.zeros((6, 4))}, r"\(5,\).*\(4,\)"),
        ({"x_train": np.zeros((19, 5))}, "x_train has 19 rows"),
    ],
)
def test_npz_errors_name_the_problem_and_file(tmp_path, change, match):
    arrays = {
        "x_train": np.zeros((20, 5)),
        "y_train": np.arange(20) % 4,
        "x_test": np.zeros((6, 5)),
        "y_test": np.arange(6) % 3,
    }
    arrays.update(change)
    np.savez(tmp_path / "bad.npz", **{k: v for k, v in arrays.items() if v is not None})
    with pytest.raises(ValueError, match=match) as err:
        load_npz(tmp_path / "bad.npz")
    assert "bad.npz" in str(err.value)


def _write_idx(path: Path, array: np.ndarray, magic: bytes | None = None) -> Path:
    header = magic if magic is not None else bytes([0, 0, 0x08, array.ndim])
    dims = b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + dims + array.astype(np.uint8).tobytes())
    return path


def test_idx_reader_round_trip_and_rejections(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    assert np.array_equal(read_idx(_write_idx(tmp_path / "a.gz", images)), images)
    labels = np.array([3, 1, 4], dtype=np.uint8)
    assert np.array_equal(read_idx(_write_idx(tmp_path / "b.gz", labels)), labels)
    with pytest.raises(ValueError, match=r"bad\.gz.*magic number 0x00000F01"):
        read_idx(_write_idx(tmp_path / "bad.gz", labels, magic=bytes([0, 0, 0x0F, 1])))
    with pytest.raises(ValueError, match=r"short\.gz.*shape \(4,\)"):
        read_idx(_short_idx(tmp_path / "short.gz"))
    (tmp_path / "plain.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match=r"plain\.gz"):
        read_idx(tmp_path / "plain.gz")


def _short_idx(path: Path) -> Path:
    """Header says 4 labels, the data has 3."""
    with gzip.open(path, "wb") as f:
        f.write(bytes([0, 0, 8, 1]) + (4).to_bytes(4, "big") + bytes([1, 2, 3]))
    return path


def _fake_fashion_mnist(directory: Path, n_train: int = 6, n_test: int = 4) -> Path:
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(directory / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    return directory


def test_fashion_mnist_from_idx_files_keeps_pixels_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.delenv("HETFL_DATA", raising=False)
    directory = _fake_fashion_mnist(tmp_path / "fm")
    ds = load_fashion_mnist(str(directory))
    assert ds.x_train.shape == (6, 1, 28, 28) and ds.x_test.shape == (4, 1, 28, 28)
    assert ds.y_train.tolist() == [0, 1, 2, 3, 4, 5] and ds.num_classes == 10
    written = np.random.default_rng(0).integers(0, 256, (6, 28, 28))  # _fake_fashion_mnist's
    assert ds.x_train.dtype == np.uint8 and np.array_equal(ds.x_train[:, 0], written)
    # Standardised per batch exactly as the float32 arithmetic x / 255 - mean, then / std.
    expected = written.astype(np.float32)
    expected *= np.float32(1 / 255)
    expected -= np.float32(0.2860)
    expected /= np.float32(0.3530)
    got = ds.pixels(torch.from_numpy(ds.x_train.copy())).numpy()[:, 0]
    assert ds.pixels is not None and np.array_equal(got, expected)
    assert load_fashion_mnist(str(directory)).x_train is ds.x_train  # decoded once
    decoded = weakref.ref(ds.x_train)
    del ds, got
    gc.collect()
    assert decoded() is None  # held weakly: freed once no data set holds it
    assert load_fashion_mnist(str(directory)).x_train.shape == (6, 1, 28, 28)  # decoded again
    monkeypatch.setenv("HETFL_DATA", str(tmp_path))  # found in $HETFL_DATA/fashion-mnist
    (tmp_path / "fashion-mnist").symlink_to(directory)
    assert load_fashion_mnist().y_test.tolist() == [0, 1, 2, 3]


def test_fashion_mnist_rejects_a_corrupt_file(tmp_path, monkeypatch):
    directory = _fake_fashion_mnist(tmp_path / "fm")
    _write_idx(directory / "t10k-labels-idx1-ubyte.gz", np.arange(3), magic=bytes([0, 0, 8, 3]))
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz"):
        load_fashion_mnist(str(directory))


def test_missing_fashion_mnist_names_the_places_and_fixes(tmp_path, monkeypatch):
    monkeypatch.delenv("HETFL_DATA", raising=False)
    monkeypatch.setenv("HETFL_CACHE", str(tmp_path / "cache"))
    system = tmp_path / "system"
    monkeypatch.setattr(fashion_mnist, "FASHION_MNIST_SYSTEM_DIR", system)
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (str(empty), None):
        with pytest.raises(DatasetNotFoundError) as err:
            load_fashion_mnist(path)
        message = str(err.value)
        assert "apt-get install dataset-fashion-mnist" in message and "HETFL_DATA" in message
        assert "hetfl data download fashion-mnist" in message
        assert str(empty if path else system) in message
    assert isinstance(err.value, FileNotFoundError)


@pytest.mark.skipif(
    not (fashion_mnist.FASHION_MNIST_SYSTEM_DIR / "train-images-idx3-ubyte.gz").exists(),
    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)",
)
def test_installed_fashion_mnist_loads(monkeypatch):
    monkeypatch.delenv("HETFL_DATA", raising=False)
    ds = load_fashion_mnist()
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert ds.num_classes == 10 and set(np.unique(ds.y_train)) == set(range(10))
    x = ds.pixels(torch.from_numpy(ds.x_train.copy()))  # the published statistics fit
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1) < 0.01


def test_dataset_rejects_wrong_dtypes():
    with pytest.raises(ValueError, match="float32"):
        Dataset(
            "d",
            np.zeros((2, 3)),
            np.zeros(2, np.int64),
            np.zeros((1, 3), np.float32),
            np.zeros(1, np.int64),
            2,
        )


def test_global_test_subsample_is_fixed_by_the_seed_and_keeps_the_order(digits):
    x, y = global_test(digits, samples=50, seed=3)
    again_x, again_y = global_test(digits, samples=50, seed=3)
    assert x.shape[0] == 50 and torch.equal(x, again_x) and torch.equal(y, again_y)
    full_x, _ = global_test(digits)
    rows = [int(torch.nonzero((full_x == row).flatten(1).all(dim=1))[0]) for row in x]
    assert rows == sorted(rows)  # a subsample in the original order
    other, _ = global_test(digits, samples=50, seed=4)
    assert not torch.equal(x, other)
    whole, _ = global_test(digits, samples=10**6)
    assert torch.equal(whole, full_x)
    with pytest.raises(ValueError, match="test samples must be >= 1"):
        global_test(digits, samples=0)
