"""Unit tests of the small core pieces: generators, the client store, batching, local SGD,
initialisation, sampling, registries and BatchNorm re-estimation."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

from hetfl.algorithms import ALGORITHMS
from hetfl.config import ConfigError, validate
from hetfl.core.client.bn_statistics import recompute_bn_statistics
from hetfl.core.client.dropout import SeededDropout, dropout_masks
from hetfl.core.client.loop import batch_order, train_local
from hetfl.core.client.program import Programs
from hetfl.core.client.recipe import LocalRecipe, TrainContext
from hetfl.core.init import initialize
from hetfl.core.model_cache import ModelCache
from hetfl.core.registry import Registry
from hetfl.core.rng import (
    SERVER,
    derive_seed,
    numpy_generator,
    sibling_generator,
    torch_generator,
)
from hetfl.core.server.assign import CyclicSampling, UniformSampling, uniform_sample
from hetfl.core.spec import Spec, full_map
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, ClientInfo, ClientTask, EvalTask, PassRecord
from hetfl.engine.checkpoint import load_checkpoint, save_checkpoint
from hetfl.engine.store import ClientStore
from hetfl.models import PlainFamily, ScalableFamily
from hetfl.systems.costs import MacCounter


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class _GlobalRngUnchanged:
    """Asserts on exit that the global torch RNG state did not move."""

    def __enter__(self) -> _GlobalRngUnchanged:
        self.before = torch.get_rng_state()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            assert torch.equal(self.before, torch.get_rng_state()), "global torch RNG was used"


# -- rng -------------------------------------------------------------------------------------------
def test_derive_seed_is_deterministic_and_63_bit():
    a = derive_seed(7, 3, 2, "train")
    assert a == derive_seed(7, 3, 2, "train")
    assert isinstance(a, int)
    assert 0 <= a < 2**63


@pytest.mark.parametrize(
    "changed",
    [
        (8, 3, 2, "train"),
        (7, 4, 2, "train"),
        (7, 3, 1, "train"),
        (7, 3, 2, "sample"),
        (7, 3, SERVER, "train"),
        (-7, 3, 2, "train"),
    ],
    ids=["seed", "round", "client", "purpose", "server", "negative-seed"],
)
def test_derive_seed_differs_when_any_part_changes(changed):
    assert derive_seed(*changed) != derive_seed(7, 3, 2, "train")


def test_derive_seed_neighbouring_seeds_are_not_neighbours():
    seeds = [derive_seed(s, 0, 0, "x") for s in range(50)]
    assert len(set(seeds)) == 50
    assert all(abs(a - b) > 2**20 for a, b in itertools.pairwise(seeds))


def test_torch_generator_streams_reproducible_and_distinct():
    a = torch.rand(8, generator=torch_generator(1, 2, 3, "train"))
    b = torch.rand(8, generator=torch_generator(1, 2, 3, "train"))
    c = torch.rand(8, generator=torch_generator(1, 2, 3, "dropout"))
    d = torch.rand(8, generator=torch_generator(1, 2, 4, "train"))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, d)
    g = torch_generator(1, 2, 3, "train")
    assert g.initial_seed() == derive_seed(1, 2, 3, "train")


def test_numpy_generator_reproducible_and_distinct():
    a = numpy_generator(1, 0, 5, "partition").random(6)
    b = numpy_generator(1, 0, 5, "partition").random(6)
    c = numpy_generator(1, 1, 5, "partition").random(6)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_generators_do_not_touch_global_rng():
    with _GlobalRngUnchanged():
        torch.rand(3, generator=torch_generator(0, 1, 2, "x"))
        derive_seed(0, 1, 2, "x")


# -- ClientStore -----------------------------------------------------------------------------------
def test_store_empty_before_first_put():
    store = ClientStore()
    assert store.get(4) == {}
    assert 4 not in store
    assert len(store) == 0
    assert list(store) == []
    assert store.nbytes() == 0


def test_store_put_copies_and_detaches():
    store = ClientStore()
    src = {"w": nn.Parameter(torch.tensor([1.0, 2.0])), "n": torch.tensor([3])}
    store.put(4, src)
    with torch.no_grad():
        src["w"].add_(100.0)
    src["n"].add_(1)
    src["extra"] = torch.zeros(1)
    got = store.get(4)
    assert set(got) == {"w", "n"}
    assert torch.equal(got["w"], torch.tensor([1.0, 2.0]))
    assert not got["w"].requires_grad
    assert torch.equal(got["n"], torch.tensor([3]))
    assert 4 in store


def test_store_put_replaces_previous_entry():
    store = ClientStore()
    store.put(1, {"a": torch.ones(2), "b": torch.ones(1)})
    store.put(1, {"a": torch.zeros(2)})
    assert set(store.get(1)) == {"a"}
    assert torch.equal(store.get(1)["a"], torch.zeros(2))
    assert len(store) == 1


def test_store_iterates_sorted_and_counts_bytes():
    store = ClientStore()
    store.put(3, {"a": torch.zeros(2, 3), "n": torch.tensor(0, dtype=torch.long)})  # 24 + 8
    store.put(1, {"b": torch.zeros(5, dtype=torch.float64)})  # 40
    assert list(store) == [1, 3]
    assert len(store) == 2
    assert store.nbytes() == 72


def test_store_entries_round_trip_through_a_checkpoint(tmp_path):
    store = ClientStore()
    store.put(2, {"w": torch.tensor([[1.0, 2.0]]), "n": torch.tensor(5)})
    store.put(9, {"head.bias": torch.tensor([0.5, -0.5])})
    save_checkpoint(tmp_path, {"round": 1, "store": store.entries()})
    other = ClientStore()
    other.put(77, {"stale": torch.ones(1)})  # replaced, not merged
    other.load_entries(load_checkpoint(tmp_path)["store"])
    assert list(other) == [2, 9]
    assert 77 not in other
    assert torch.equal(other.get(2)["w"], torch.tensor([[1.0, 2.0]]))
    assert torch.equal(other.get(2)["n"], torch.tensor(5))
    assert torch.equal(other.get(9)["head.bias"], torch.tensor([0.5, -0.5]))
    assert other.nbytes() == store.nbytes()


def test_store_load_entries_accepts_string_ids():
    store = ClientStore()
    store.load_entries({"3": {"a": torch.ones(1)}})
    assert 3 in store
    assert list(store) == [3]


# -- batch_order -----------------------------------------------------------------------------------
def test_batch_order_epochs_fresh_permutations_and_short_last_batch():
    settings = LocalTraining(lr=0.1, epochs=3, batch_size=4)
    batches = batch_order(10, settings, _gen(0))
    assert [len(b) for b in batches] == [4, 4, 2] * 3
    epochs = [torch.cat(batches[3 * e : 3 * e + 3]) for e in range(3)]
    for perm in epochs:
        assert torch.equal(torch.sort(perm).values, torch.arange(10))
    assert not torch.equal(epochs[0], epochs[1]) or not torch.equal(epochs[1], epochs[2])
    assert not torch.equal(epochs[0], torch.arange(10))


def test_batch_order_steps_override_epochs_within_one_epoch():
    settings = LocalTraining(lr=0.1, epochs=5, steps=2, batch_size=4)
    batches = batch_order(10, settings, _gen(1))
    assert [len(b) for b in batches] == [4, 4]
    seen = torch.cat(batches)
    assert len(set(seen.tolist())) == 8


def test_batch_order_steps_beyond_one_epoch():
    settings = LocalTraining(lr=0.1, epochs=1, steps=5, batch_size=4)
    batches = batch_order(10, settings, _gen(2))
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4]
    first = torch.cat(batches[:3])
    assert torch.equal(torch.sort(first).values, torch.arange(10))
    second = torch.cat(batches[3:])
    assert len(set(second.tolist())) == 8
    assert all(0 <= i < 10 for i in second.tolist())


def test_batch_order_same_seed_same_order_and_batch_size_larger_than_data():
    s = LocalTraining(lr=0.1, epochs=2, batch_size=3)
    a = batch_order(7, s, _gen(5))
    b = batch_order(7, s, _gen(5))
    c = batch_order(7, s, _gen(6))
    assert len(a) == len(b) == 6
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    big = batch_order(5, LocalTraining(lr=0.1, batch_size=64), _gen(0))
    assert len(big) == 1
    assert torch.equal(torch.sort(big[0]).values, torch.arange(5))


def test_batch_order_does_not_touch_global_rng():
    with _GlobalRngUnchanged():
        batch_order(20, LocalTraining(lr=0.1, epochs=2, batch_size=3), _gen(0))


# -- LocalTraining ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 0.0},
        {"lr": -0.1},
        {"lr": math.nan},
        {"lr": math.inf},
        {"lr": 0.1, "batch_size": 0},
        {"lr": 0.1, "momentum": 1.0},
        {"lr": 0.1, "momentum": -0.1},
        {"lr": 0.1, "weight_decay": -1e-4},
        {"lr": 0.1, "steps": 0},
        {"lr": 0.1, "epochs": 0},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_local_training_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        LocalTraining(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"weight_decay": math.nan}, {"clip_grad_norm": -1.0}, {"clip_grad_norm": math.nan}],
    ids=["weight_decay=nan", "clip=-1", "clip=nan"],
)
def test_local_training_rejects_non_finite_decay_and_bad_clip(kwargs):
    with pytest.raises(ValueError):
        LocalTraining(lr=0.1, **kwargs)


def test_local_training_accepts_edge_values():
    s = LocalTraining(lr=1e-9, epochs=0, steps=1, batch_size=1, momentum=0.0, weight_decay=0.0)
    assert s.num_steps(1000) == 1
    assert LocalTraining(lr=0.1, momentum=0.999).momentum == 0.999


def test_a_task_config_with_an_unknown_setting_is_refused_naming_it():
    """A setting the record lacks used to be dropped without a word (a typo such as
    `momentm` trained without momentum); now a dict config is refused and the record names
    the key."""
    with pytest.raises(TypeError, match="must be a LocalTraining record, got dict"):
        ClientTask(0, Spec(model="lin"), {}, [], {"lr": 0.1, "momentm": 0.9})
    with pytest.raises(TypeError, match="unexpected keyword argument 'momentm'"):
        LocalTraining(lr=0.1, momentm=0.9)  # type: ignore[call-arg]


def test_the_config_defaults_are_the_records():
    """Each default is written once, in `LocalTraining` (and `LrSchedule`): an empty
    `train:` section builds the record's defaults, schedule included."""
    assert validate({}).train.local_training() == LocalTraining()


def test_local_training_num_steps():
    assert LocalTraining(lr=0.1, epochs=2, batch_size=4).num_steps(10) == 6
    assert LocalTraining(lr=0.1, epochs=1, batch_size=5).num_steps(10) == 2
    assert LocalTraining(lr=0.1, epochs=3, steps=7, batch_size=4).num_steps(10) == 7


# -- train_local: one SGD step against a hand computation ------------------------------------------
def test_one_sgd_step_matches_hand_computed_cross_entropy_gradient():
    w0 = [[0.1, -0.2], [0.3, 0.4], [-0.5, 0.6]]
    b0 = [0.05, -0.1, 0.2]
    xs = [[1.0, 2.0], [-1.0, 0.5], [0.3, -0.7], [2.0, 1.0]]
    ys = [0, 2, 1, 2]
    lr = 0.1

    model = nn.Linear(2, 3)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(w0))
        model.bias.copy_(torch.tensor(b0))
    x, y = torch.tensor(xs), torch.tensor(ys)
    data = ClientData(0, x, y, x[:0], y[:0], 3)
    settings = LocalTraining(lr=lr, steps=1, batch_size=4)
    task = ClientTask(0, Spec(model="lin"), {}, full_map(["weight", "bias"]))
    params = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}
    ctx = TrainContext(task=task, received={}, generator=_gen(0), settings=settings, params=params)
    stats = train_local(model, data, LocalRecipe(), ctx)

    # by hand, in float64, without autograd: d(mean CE)/dz = (softmax(z) - onehot(y)) / n
    W = torch.tensor(w0, dtype=torch.float64)
    b = torch.tensor(b0, dtype=torch.float64)
    X = torch.tensor(xs, dtype=torch.float64)
    z = X @ W.T + b
    e = torch.exp(z - z.max(dim=1, keepdim=True).values)
    p = e / e.sum(dim=1, keepdim=True)
    onehot = torch.zeros(4, 3, dtype=torch.float64)
    onehot[torch.arange(4), torch.tensor(ys)] = 1.0
    G = (p - onehot) / 4
    w_expected = W - lr * (G.T @ X)
    b_expected = b - lr * G.sum(dim=0)
    loss_expected = float(-torch.log(p[torch.arange(4), torch.tensor(ys)]).mean())

    assert torch.allclose(params["weight"].detach().double(), w_expected, atol=1e-6, rtol=0)
    assert torch.allclose(params["bias"].detach().double(), b_expected, atol=1e-6, rtol=0)
    assert not torch.allclose(params["weight"].detach().double(), W, atol=1e-4)
    assert torch.equal(model.weight.detach(), torch.tensor(w0))  # the template is untouched
    assert stats.num_steps == 1
    assert stats.samples_seen == 4
    assert stats.default_passes == {4: 1}
    assert stats.loss == pytest.approx(loss_expected, abs=1e-6)


# -- initialize ------------------------------------------------------------------------------------
def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 4), nn.LayerNorm(4)
    )


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_initialize_same_seed_same_state_different_seed_different():
    m1, m2, m3 = _net(), _net(), _net()  # constructors draw from the global RNG: not timed
    assert not _same_state(m1, m2)
    with _GlobalRngUnchanged():
        initialize(m1, torch_generator(0, 0, SERVER, "init"))
        initialize(m2, torch_generator(0, 0, SERVER, "init"))
        initialize(m3, torch_generator(1, 0, SERVER, "init"))
    assert _same_state(m1, m2)
    assert not torch.equal(m1[0].weight, m3[0].weight)
    assert not torch.equal(m1[3].weight, m3[3].weight)


def test_initialize_bounds_and_norm_defaults():
    m = _net()
    with torch.no_grad():
        m[1].running_mean.fill_(3.0)
        m[1].weight.fill_(7.0)
        m[1].num_batches_tracked.fill_(9)
    assert initialize(m, _gen(3)) is m
    assert float(m[3].weight.detach().abs().max()) <= 1 / math.sqrt(8)
    assert float(m[3].bias.detach().abs().max()) <= 1 / math.sqrt(8)
    assert float(m[0].weight.detach().abs().max()) <= 1 / math.sqrt(9)
    assert torch.equal(m[1].weight, torch.ones(2))
    assert torch.equal(m[1].bias, torch.zeros(2))
    assert torch.equal(m[1].running_mean, torch.zeros(2))
    assert torch.equal(m[1].running_var, torch.ones(2))
    assert int(m[1].num_batches_tracked) == 0
    assert torch.equal(m[4].weight, torch.ones(4))


def test_initialize_rejects_unknown_parametrised_layer():
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Parameter(torch.zeros(3))

    with pytest.raises(TypeError, match="Odd"):
        initialize(nn.Sequential(Odd()), _gen(0))


# -- uniform_sample --------------------------------------------------------------------------------
def _infos(ids: list[int]) -> list[ClientInfo]:
    return [ClientInfo(cid=i, n_train=10, input_shape=(1,), labels=(0,)) for i in ids]


def test_uniform_sample_k_at_least_available_returns_all_sorted():
    pool = _infos([5, 1, 9, 3])
    with _GlobalRngUnchanged():
        for k in (4, 10):
            assert [c.cid for c in uniform_sample(pool, k, _gen(0))] == [1, 3, 5, 9]


def test_uniform_sample_k_distinct_sorted_reproducible():
    pool = _infos(list(range(30, 0, -1)))
    with _GlobalRngUnchanged():
        a = [c.cid for c in uniform_sample(pool, 7, _gen(11))]
        b = [c.cid for c in uniform_sample(pool, 7, _gen(11))]
    assert a == b
    assert len(a) == 7
    assert len(set(a)) == 7
    assert a == sorted(a)
    assert set(a) <= set(range(1, 31))
    draws = {tuple(c.cid for c in uniform_sample(pool, 7, _gen(s))) for s in range(10)}
    assert len(draws) > 1


def test_cyclic_sampling_draws_every_client_once_per_pass_and_resumes():
    clients = _infos(list(range(10)))
    sampler = CyclicSampling(3)
    sampler.setup(clients)
    rounds = [[c.cid for c in sampler.sample(r, clients, _gen(r))] for r in (1, 2, 3)]
    assert all(len(r) == 3 and r == sorted(r) for r in rounds)
    drawn = [cid for r in rounds for cid in r]
    assert len(set(drawn)) == 9  # no client twice in the pass
    (left,) = set(range(10)) - set(drawn)
    saved = sampler.extra_state()
    assert saved == {"sampler_drawn": sorted(drawn)}
    fourth = [c.cid for c in sampler.sample(4, clients, _gen(4))]
    assert left in fourth and len(fourth) == 3 == len(set(fourth))  # the pass ends, one begins
    assert sampler.drawn == set(fourth) - {left}
    resumed = CyclicSampling(3)
    resumed.setup(clients)
    resumed.load_extra_state(saved)
    assert [c.cid for c in resumed.sample(4, clients, _gen(4))] == fourth


def test_the_sampling_option_chooses_the_sampler():
    cfg = validate({"options": {"fedavg": {"sampling": "cyclic"}}})
    opts = ALGORITHMS.get("fedavg").options(**cfg.options["fedavg"])
    assert isinstance(opts.sampler(2), CyclicSampling)
    assert isinstance(ALGORITHMS.get("heterofl").options().sampler(2), UniformSampling)
    with pytest.raises(ConfigError, match=r"options\.fedavg\.sampling: .*'uniform' or 'cyclic'"):
        validate({"options": {"fedavg": {"sampling": "round-robin"}}})


# -- Registry --------------------------------------------------------------------------------------
def test_registry_duplicate_registration_raises_and_keeps_first():
    reg: Registry[int] = Registry("algorithm")
    reg.register("fedavg", 1)
    with pytest.raises(ValueError, match="fedavg"):
        reg.register("fedavg", 2)
    assert reg.get("fedavg") == 1

    @reg.decorator("fedprox")
    def fn() -> None: ...

    assert reg.get("fedprox") is fn
    with pytest.raises(ValueError):
        reg.decorator("fedprox")(fn)
    assert reg.names() == ["fedavg", "fedprox"]
    assert list(reg) == ["fedavg", "fedprox"]
    assert "fedavg" in reg
    assert "nope" not in reg


def test_register_algorithm_stacks_one_decorator_per_name_and_refuses_duplicates(monkeypatch):
    from hetfl.algorithms.fedavg import FedAvgOptions, FedBNOptions
    from hetfl.algorithms.parts import method_registry

    registry: Registry[method_registry.Algorithm] = Registry("algorithm")
    monkeypatch.setattr(method_registry, "ALGORITHMS", registry)

    def make(*args, **kwargs):  # never called: registration only stores it
        raise AssertionError

    summaries = {"a": "first", "b": "second"}
    decorated = method_registry.register_algorithm("a", FedAvgOptions, summaries=summaries)(
        method_registry.register_algorithm(
            "b", FedBNOptions, needs="scalable", summaries=summaries
        )(make)
    )
    assert decorated is make
    assert registry.names() == ["a", "b"]
    assert registry.get("a") == method_registry.Algorithm("a", "first", FedAvgOptions, make, "any")
    assert registry.get("b") == method_registry.Algorithm(
        "b", "second", FedBNOptions, make, "scalable"
    )
    with pytest.raises(ValueError, match="algorithm 'a' is already registered"):
        method_registry.register_algorithm("a", FedBNOptions, summaries={"a": "again"})(make)
    assert registry.get("a").summary == "first"
    with pytest.raises(KeyError, match=r"no summary in hetfl\.catalogue\.ALGORITHMS"):
        method_registry.register_algorithm("c", FedAvgOptions, summaries=summaries)


def test_methods_sharing_a_make_register_one_name_per_decorator():
    from hetfl.algorithms import ALGORITHMS

    for names in (("fedavg", "fedbn", "fedper"), ("fedadagrad", "fedadam", "fedyogi")):
        makes = {ALGORITHMS.get(n).make for n in names}
        assert len(makes) == 1, names
    assert [ALGORITHMS.get(n).needs for n in ("fedavg", "fedbn", "fedper")] == [
        "any",
        "scalable",
        "any",
    ]


def test_registry_unknown_name_suggests_closest():
    reg: Registry[int] = Registry("algorithm")
    for i, name in enumerate(["fedavg", "heterofl", "fedprox", "scalablefl"]):
        reg.register(name, i)
    with pytest.raises(KeyError) as info:
        reg.get("heterof")
    msg = str(info.value)
    assert "did you mean 'heterofl'?" in msg
    assert "unknown algorithm 'heterof'" in msg
    assert "fedavg, fedprox, heterofl, scalablefl" in msg
    with pytest.raises(KeyError) as info2:
        reg.get("zzzzzz")
    assert "did you mean" not in str(info2.value)


# -- global RNG around a client's fit --------------------------------------------------------------
def _mlp_setup():
    family = PlainFamily("mlp", (1, 2, 2), 3)
    spec = family.global_spec([])
    imap = family.index_map(spec)
    state = initialize(family.build(spec), torch_generator(0, 0, SERVER, "init")).state_dict()
    x = torch.rand(8, 1, 2, 2, generator=_gen(0))
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    data = ClientData(0, x, y, x[:0], y[:0], 3)
    return family, spec, imap, state, data


def _task(cid, spec, imap, state):
    payload = {e.local: state[e.local] for e in imap}
    return ClientTask(cid, spec, payload, imap, LocalTraining(lr=0.1, steps=2, batch_size=4))


def test_client_fit_with_cached_model_does_not_touch_global_rng():
    family, spec, imap, state, data = _mlp_setup()
    program = Programs(family, seed=0).program_for(0)
    task = _task(0, spec, imap, state)
    first = program.fit(task, data, {}, torch_generator(0, 1, 0, "train"), info=data.info())  # warm
    with _GlobalRngUnchanged():
        again = program.fit(task, data, {}, torch_generator(0, 1, 0, "train"), info=data.info())
    for k in first.result.tensors:
        assert torch.equal(first.result.tensors[k], again.result.tensors[k])
    assert not torch.equal(first.result.tensors["head.weight"], state["head.weight"])


def test_client_fit_first_build_does_not_touch_global_rng():
    family, spec, imap, state, data = _mlp_setup()
    program = Programs(family, seed=0).program_for(0)
    with _GlobalRngUnchanged():
        program.fit(
            _task(0, spec, imap, state),
            data,
            {},
            torch_generator(0, 1, 0, "train"),
            info=data.info(),
        )


def test_client_fit_private_init_does_not_touch_global_rng():
    family, spec, imap, state, data = _mlp_setup()
    programs = Programs(family, seed=0)
    programs.program_for(0).fit(
        _task(0, spec, imap, state), data, {}, torch_generator(0, 1, 0, "train"), info=data.info()
    )
    shared = [e for e in imap if not e.local.startswith("head.")]
    as_client_1 = replace(data.info(), cid=1)
    with _GlobalRngUnchanged():
        out = programs.program_for(1).fit(
            _task(1, spec, shared, state), data, {}, torch_generator(0, 1, 1, "t"), info=as_client_1
        )
    assert sorted(out.private) == ["head.bias", "head.weight"]


def test_client_fit_refuses_another_clients_info():
    family, spec, imap, state, data = _mlp_setup()
    with pytest.raises(
        ValueError, match="program got a task for client 0 and the info of client 1"
    ):
        Programs(family).program_for(0).fit(
            _task(0, spec, imap, state),
            data,
            {},
            torch.Generator(),
            info=replace(data.info(), cid=1),
        )


# -- keep_momentum: buffers as private state ------------------------------------------------------
@pytest.mark.parametrize("keep", [True, False])
def test_kept_momentum_makes_two_rounds_one_continuous_sgd_run(keep):
    """One client alone, two rounds, the second starting from the first's weights: with
    keep_momentum that is one SGD-with-momentum run over both rounds' batches (a plain
    PyTorch loop, one optimiser); without it the second round restarts the buffers."""
    family, spec, imap, state, data = _mlp_setup()
    config = LocalTraining(lr=0.1, steps=3, batch_size=4, momentum=0.9, keep_momentum=keep)
    program = Programs(family, seed=0).program_for(0)
    first = program.fit(
        ClientTask(0, spec, dict(state), imap, config),
        data,
        {},
        torch_generator(0, 1, 0, "t"),
        info=data.info(),
    )
    assert sorted(first.private) == (sorted(f"momentum/{k}" for k in state) if keep else [])
    second = program.fit(
        ClientTask(0, spec, first.result.tensors, imap, config),
        data,
        first.private,
        torch_generator(0, 2, 0, "t"),
        info=data.info(),
    )

    model = family.build(spec)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    settings = config
    for rnd in (1, 2):
        for idx in batch_order(8, settings, torch_generator(0, rnd, 0, "t")):
            opt.zero_grad()
            nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
            opt.step()
    continuous = all(
        torch.allclose(second.result.tensors[k], v, rtol=0, atol=1e-7)
        for k, v in model.state_dict().items()
    )
    assert continuous == keep


def test_a_kept_buffer_of_another_shape_starts_afresh():
    """A client that gets another sub-model drops the buffers that no longer fit."""
    family, spec, imap, state, data = _mlp_setup()
    config = LocalTraining(lr=0.1, steps=2, batch_size=4, momentum=0.9, keep_momentum=True)
    task = ClientTask(0, spec, dict(state), imap, config)
    stale = {"momentum/head.weight": torch.ones(2, 2)}
    info = data.info()
    fresh = (
        Programs(family, seed=0)
        .program_for(0)
        .fit(task, data, {}, torch_generator(0, 1, 0, "t"), info=info)
    )
    out = (
        Programs(family, seed=0)
        .program_for(0)
        .fit(task, data, stale, torch_generator(0, 1, 0, "t"), info=info)
    )
    for k in fresh.result.tensors:
        assert torch.equal(out.result.tensors[k], fresh.result.tensors[k])
    assert out.private["momentum/head.weight"].shape == state["head.weight"].shape


def test_keep_momentum_without_momentum_is_refused():
    with pytest.raises(ValueError, match="keep_momentum needs momentum > 0"):
        LocalTraining(lr=0.1, keep_momentum=True)


# -- recompute_bn_statistics -----------------------------------------------------------------------
_BN_X = [
    [1.0, 2.0],
    [3.0, -1.0],
    [0.0, 5.0],
    [4.0, 4.0],
    [2.0, 0.0],
    [7.0, 1.0],
    [-3.0, 2.0],
    [1.0, 1.0],
]


def _bn_model() -> nn.Module:
    lin = nn.Linear(2, 2)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 0.5], [-0.5, 2.0]]))
        lin.bias.copy_(torch.tensor([0.25, -1.0]))
    model = nn.Sequential(lin, nn.BatchNorm1d(2, momentum=0.3))
    with torch.no_grad():
        model[1].running_mean.fill_(100.0)
        model[1].running_var.fill_(-5.0)
    return model


def _hand_bn_stats() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor(_BN_X, dtype=torch.float64)
    w = torch.tensor([[1.0, 0.5], [-0.5, 2.0]], dtype=torch.float64)
    h = x @ w.T + torch.tensor([0.25, -1.0], dtype=torch.float64)
    n = h.shape[0]
    mean = h.sum(dim=0) / n
    var = ((h - mean) ** 2).sum(dim=0) / (n - 1)
    return mean, var


def _check_bn(batch_size: int) -> None:
    model = _bn_model()
    model.train()
    recompute_bn_statistics(model, torch.tensor(_BN_X), batch_size=batch_size)
    mean, var = _hand_bn_stats()
    bn = model[1]
    assert not model.training
    assert bn.momentum == 0.3
    assert torch.allclose(bn.running_mean.double(), mean, atol=1e-5, rtol=0), (
        bn.running_mean,
        mean,
    )
    assert torch.allclose(bn.running_var.double(), var, atol=1e-5, rtol=0), (bn.running_var, var)


@pytest.mark.parametrize("batch_size", [8, 100, 500])
def test_recompute_bn_statistics_one_batch(batch_size):
    _check_bn(batch_size)


@pytest.mark.parametrize("batch_size", [4, 3])
def test_recompute_bn_statistics_several_batches_average_batch_statistics(batch_size):
    """HeteroFL's definition: the mean of per-batch means and of per-batch unbiased variances."""
    model = _bn_model()
    recompute_bn_statistics(model, torch.tensor(_BN_X), batch_size=batch_size)
    x = torch.tensor(_BN_X, dtype=torch.float64)
    w = torch.tensor([[1.0, 0.5], [-0.5, 2.0]], dtype=torch.float64)
    h = x @ w.T + torch.tensor([0.25, -1.0], dtype=torch.float64)
    chunks = [h[i : i + batch_size] for i in range(0, h.shape[0], batch_size)]
    means = [c.sum(dim=0) / c.shape[0] for c in chunks]
    variances = [
        ((c - m) ** 2).sum(dim=0) / (c.shape[0] - 1) for c, m in zip(chunks, means, strict=True)
    ]
    bn = model[1]
    torch.testing.assert_close(bn.running_mean.double(), sum(means) / len(means), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        bn.running_var.double(), sum(variances) / len(variances), atol=1e-5, rtol=0
    )


# -- dropout with a generator of its own ----------------------------------------------------------
def test_seeded_dropout_draws_inverted_masks_from_its_generator_only_in_training():
    layer = SeededDropout(0.5)
    x = torch.arange(1.0, 13.0).reshape(3, 4)
    with pytest.raises(RuntimeError, match="needs a generator"):
        layer(x)  # never a silent draw from the global RNG
    with _GlobalRngUnchanged(), dropout_masks(layer, _gen(5)):
        first, second = layer(x), layer(x)
    by_hand = _gen(5)
    for out in (first, second):  # each forward draws the next mask of the stream
        keep = torch.empty(3, 4).bernoulli_(0.5, generator=by_hand)
        assert torch.equal(out, x * keep * 2)
    assert not torch.equal(first, second) and layer.generator is None
    layer.eval()
    assert torch.equal(layer(x), x)
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        SeededDropout(1.0)


class _DropoutMLP(nn.Module):
    """Dropout before each of two hidden layers, as VGG-11's classifier has it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Flatten(), SeededDropout(0.5), nn.Linear(12, 16), nn.ReLU(),
            SeededDropout(0.5), nn.Linear(16, 16), nn.ReLU(),
        )  # fmt: skip
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class _DropoutFamily:
    names = ("body.2.weight", "body.2.bias", "body.5.weight", "body.5.bias", "head.weight",
             "head.bias")  # fmt: skip

    def build(self, spec):
        return _DropoutMLP()

    def index_map(self, spec):
        return full_map(self.names)

    def global_spec(self, specs):
        return Spec(model="dropout-mlp")


def _dropout_round(programs, rnd, cids, state, data):
    """Each client's result of one step from `state` in round `rnd`, in the order given."""
    spec = programs.family.global_spec([])
    imap = programs.family.index_map(spec)
    config = LocalTraining(lr=0.5, steps=1, batch_size=4)
    return {
        c: programs.program_for(c)
        .fit(
            ClientTask(c, spec, state, imap, config),
            data[c],
            {},
            torch_generator(0, rnd, c, "t"),
            info=data[c].info(),
        )
        .result
        for c in cids
    }


def test_dropout_masks_are_per_round_and_client_and_a_round_is_order_free():
    """The client program hands the model a dropout generator per (seed, round, client):
    the masks are the ones drawn from it in module order, they differ between clients and
    rounds, and a round's results are the same in either client order; evaluation drops
    nothing; MACs of a training pass price the model whatever the masks."""
    family = _DropoutFamily()
    spec = family.global_spec([])
    programs = Programs(family, seed=0)
    model = programs.models.model_for(spec)
    state = initialize(family.build(spec), _gen(0)).state_dict()
    g = _gen(1)
    data = {c: ClientData(c, torch.randn(4, 3, 2, 2, generator=g), torch.tensor([0, 1, 2, 0]),
                          torch.randn(5, 3, 2, 2, generator=g), torch.arange(5) % 3, 3)
            for c in (0, 1)}  # fmt: skip
    seen = []
    for layer in (model.body[1], model.body[4]):
        layer.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))

    forward = _dropout_round(programs, 1, [0, 1], state, data)
    backward = _dropout_round(Programs(family, seed=0), 1, [1, 0], state, data)
    for c in (0, 1):
        for k, v in forward[c].tensors.items():
            assert torch.equal(v, backward[c].tensors[k]), (c, k)
    _dropout_round(programs, 2, [0], state, data)
    masks = []
    for rnd, cid in ((1, 0), (1, 1), (2, 0)):  # the fits `seen` recorded, in order
        by_hand = sibling_generator(torch_generator(0, rnd, cid, "t"), "dropout")
        for _ in range(2):  # the first dropout layer's mask, then the second's
            x, out = seen.pop(0)
            keep = torch.empty_like(x).bernoulli_(0.5, generator=by_hand)
            assert torch.equal(out, x * keep / 0.5)
            masks.append(keep)
    assert not seen and all(not torch.equal(a, b) for a, b in itertools.combinations(masks, 2))

    task = EvalTask(0, spec, state, family.index_map(spec))
    evaluation = ModelCache(family)
    program = programs.program_for(0)
    assert program.evaluate(task, data[0], {}, evaluation) == program.evaluate(
        task, data[0], {}, evaluation
    )
    model = evaluation.model_for(spec)
    x = data[0].x_test
    with torch.no_grad():
        plain = model.head(nn.Sequential(*model.body[:1], *model.body[2:4], *model.body[5:])(x))
        assert torch.equal(model(x), plain)  # eval mode: the layers pass through
    # forward 4 * (12*16 + 16*16 + 16*3) = 1984 MACs, the weights' gradients as many again,
    # the inputs' gradients 4 * (16*16 + 16*3) (the data needs none)
    assert MacCounter(family).pass_macs(PassRecord(spec, "train", 4, 1), (3, 2, 2)) == 5184


def test_vgg11_classifier_drops_with_p_half_before_both_hidden_layers():
    """FedNova's VGG-11 classifier, with the seeded layer that the test above checks."""
    family = PlainFamily("vgg11", (3, 32, 32), 10)
    with torch.device("meta"):
        model = family.build(family.global_spec([]))
    assert [type(m).__name__ for m in model.body] == [
        "SeededDropout", "Linear", "ReLU", "SeededDropout", "Linear", "ReLU"
    ]  # fmt: skip
    assert model.body[0].p == model.body[3].p == 0.5
    assert sum(p.numel() for p in model.parameters()) == 9_750_922


# -- local optimisers: functional steps equal torch.optim's ---------------------------------------
@pytest.mark.parametrize("optimizer", ["adam", "amsgrad"])
def test_adam_local_training_equals_torch_optim_adam_bit_for_bit(optimizer):
    """Three steps of Adam / AMSGrad with L2 weight decay through the client program equal
    a plain loop with `torch.optim.Adam` (foreach) on the same batches, bit for bit; with
    keep_momentum the moments come back under the `adam.*/<param>` names."""
    family, spec, imap, state, data = _mlp_setup()
    config = LocalTraining(
        lr=0.01, steps=3, batch_size=4, optimizer=optimizer, betas=(0.8, 0.99), eps=1e-6,
        weight_decay=0.1, keep_momentum=True,
    )  # fmt: skip
    task = ClientTask(0, spec, dict(state), imap, config)
    out = (
        Programs(family, seed=0)
        .program_for(0)
        .fit(task, data, {}, torch_generator(0, 1, 0, "t"), info=data.info())
    )
    model = family.build(spec)
    model.load_state_dict(state)
    opt = torch.optim.Adam(
        model.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1,
        amsgrad=optimizer == "amsgrad", foreach=True,
    )  # fmt: skip
    for idx in batch_order(8, config, torch_generator(0, 1, 0, "t")):
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
        opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(out.result.tensors[k], v), k
    for k, p in model.named_parameters():
        assert torch.equal(out.private[f"adam.exp_avg_sq/{k}"], opt.state[p]["exp_avg_sq"])
        assert float(out.private[f"adam.step/{k}"]) == 3.0
    assert any(k.startswith("adam.max_exp_avg_sq/") for k in out.private) == (
        optimizer == "amsgrad"
    )


def test_adam_kept_state_makes_two_rounds_one_run():
    """With keep_momentum, Adam's moments and step count carry over: two rounds of 2 steps
    equal one torch.optim.Adam run of 4 steps (bias correction included)."""
    family, spec, imap, state, data = _mlp_setup()
    config = LocalTraining(lr=0.01, steps=2, batch_size=4, optimizer="adam", keep_momentum=True)
    program = Programs(family, seed=0).program_for(0)
    first = program.fit(
        ClientTask(0, spec, dict(state), imap, config), data, {}, torch_generator(0, 1, 0, "t"),
        info=data.info(),
    )  # fmt: skip
    second = program.fit(
        ClientTask(0, spec, first.result.tensors, imap, config), data, first.private,
        torch_generator(0, 2, 0, "t"), info=data.info(),
    )  # fmt: skip
    model = family.build(spec)
    model.load_state_dict(state)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)
    for rnd in (1, 2):
        for idx in batch_order(8, config, torch_generator(0, rnd, 0, "t")):
            opt.zero_grad(set_to_none=False)
            nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
            opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(second.result.tensors[k], v), k


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"betas": (0.5, 0.9)}, r"betas=\(0\.5, 0\.9\) set for optimizer 'sgd'"),
        ({"eps": 1e-3}, r"eps=0\.001 set for optimizer 'sgd'"),
        ({"optimizer": "adam", "momentum": 0.9}, r"momentum=0\.9 set for optimizer 'adam'"),
        ({"optimizer": "adam", "betas": (0.9, 1.0)}, r"betas must be two numbers in \[0, 1\)"),
        ({"optimizer": "adam", "eps": 0.0}, "eps must be a positive finite number, got 0.0"),
        ({"optimizer": "rmsprop"}, "optimizer must be 'sgd', 'adam' or 'amsgrad', got 'rmsprop'"),
    ],
)
def test_local_training_refuses_settings_of_another_optimiser(settings, match):
    with pytest.raises(ValueError, match=match):
        LocalTraining(**settings)


# -- programs: one per client, a shared template cache, wrappers -----------------------------------
def test_programs_for_many_clients_share_one_model_per_spec():
    """Programs for 50 clients, each trained once, leave one template per spec in the
    shared cache, and no client's tensors in it."""
    family, spec, imap, state, data = _mlp_setup()
    programs = Programs(family, seed=0)
    for cid in range(50):
        client = replace(data, cid=cid)
        programs.program_for(cid).fit(
            _task(cid, spec, imap, state), client, {}, torch_generator(0, 1, cid, "t"),
            info=client.info(),
        )  # fmt: skip
    assert len(programs.models) == 1
    template = programs.models.model_for(spec).state_dict()
    built = family.build(spec).state_dict()
    assert all(torch.equal(template[k], built[k]) for k in built)  # untouched by training


def test_functional_training_updates_the_clients_batchnorm_statistics():
    """BatchNorm's running statistics and num_batches_tracked, updated in place on the
    buffers the loop passes to functional_call, come back in the client's tensors (one
    step, so that the module forward by hand runs on the same weights)."""
    fam = ScalableFamily(
        {"family": "stage-cnn", "input_shape": (1, 8, 8), "num_classes": 3, "stages": 1}
    )
    spec = fam.global_spec([])
    state = initialize(fam.build(spec), _gen(0)).state_dict()
    x = torch.randn(8, 1, 8, 8, generator=_gen(1))
    data = ClientData(0, x, torch.arange(8) % 3, x[:0], torch.arange(0), 3)
    config = LocalTraining(lr=0.1, steps=1, batch_size=4)  # one step: the forward's weights
    task = ClientTask(0, spec, dict(state), fam.index_map(spec), config)
    out = (
        Programs(fam, seed=0)
        .program_for(0)
        .fit(task, data, {}, torch_generator(0, 1, 0, "t"), info=data.info())
    )
    model = fam.build(spec)
    model.load_state_dict(state)
    model.train()
    for idx in batch_order(8, config, torch_generator(0, 1, 0, "t")):
        model(x[idx])
    tracked = [k for k in state if k.endswith("num_batches_tracked")]
    assert tracked and all(int(out.result.tensors[k]) == 1 for k in tracked)
    for k in state:
        if "running" in k:
            assert torch.equal(out.result.tensors[k], model.state_dict()[k]), k


class _ScalesClientOne:
    """A wrapper (at module level: wrappers must pickle) scaling client 1's tensors by 3."""

    def __init__(self, inner):
        self.inner, self.cid, self.device = inner, inner.cid, inner.device

    def fit(self, task, data, private, generator, **kwargs):
        out = self.inner.fit(task, data, private, generator, **kwargs)
        if self.cid == 1:
            out.result.tensors = {k: 3 * v for k, v in out.result.tensors.items()}
        return out

    def evaluate(self, *args):
        return self.inner.evaluate(*args)


def test_a_wrapper_changes_only_its_clients_result():
    """A wrapper that scales client 1's returned tensors by 3: client 1's result is 3 times
    the unwrapped one, client 0's equals the unwrapped one exactly."""
    family, spec, imap, state, data = _mlp_setup()

    def run(programs):
        results = {}
        for cid in (0, 1):
            client = replace(data, cid=cid)
            results[cid] = programs.program_for(cid).fit(
                _task(cid, spec, imap, state), client, {}, torch_generator(0, 1, cid, "t"),
                info=client.info(),
            ).result.tensors  # fmt: skip
        return results

    honest = run(Programs(family, seed=0))
    wrapped = run(Programs(family, seed=0, wrappers=[_ScalesClientOne]))
    for k in honest[0]:
        assert torch.equal(wrapped[0][k], honest[0][k])
        assert torch.equal(wrapped[1][k], 3 * honest[1][k])
