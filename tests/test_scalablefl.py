"""ScalableFL (METHODS.md §1): the paper's own numbers, per-group sampling, private layers,
HeteroFL's parameter matching against a brute-force search, client views by hand, and a
short run on real data.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.scalablefl import group_key
from hetfl.assembly import build_federation
from hetfl.config import ConfigError, expand_sweep, load_raw, validate
from hetfl.core.client.loop import train_local
from hetfl.core.client.program import Programs
from hetfl.core.client.recipe import LocalRecipe, TrainContext
from hetfl.core.init import initialize
from hetfl.core.rng import torch_generator
from hetfl.core.roles import head_tensor_names, norm_tensor_names
from hetfl.core.schedule import LrSchedule
from hetfl.core.server.strategy import Strategy
from hetfl.core.spec import local_names
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, ClientInfo, ClientResult, ClientTask
from hetfl.data import PARTITIONERS, Dataset, build_clients, global_test, load_digits
from hetfl.data.views import ClientView, ViewGroup, draw_views, remap_labels, resize_images
from hetfl.engine.round_settings import RoundSettings
from hetfl.models import ScalableFamily
from hetfl.models.matching import ParameterCount, match_parameters, parameter_count
from hetfl.models.scaling import scaled_depth
from hetfl.models.slim import channels
from hetfl.sim import Simulation
from strategies import trained

TRAIN = LocalTraining(lr=0.1, steps=2, batch_size=8, momentum=0.9, weight_decay=5e-4)
IMAGENET = ((256, 1000), (192, 500), (128, 200), (96, 100))  # (H, K) of Table VIII


def _infos(groups, per_group: int = 1, channels_in: int = 3) -> list[ClientInfo]:
    return [
        ClientInfo(g * per_group + j, 100, (channels_in, h, h), tuple(range(k)))
        for g, (h, k) in enumerate(groups)
        for j in range(per_group)
    ]


def _strategy(family, cpr: int = 1, train: LocalTraining = TRAIN, **opts) -> Strategy:
    strategy, _ = ALGORITHMS.get("scalablefl").build(
        family, opts, clients_per_round=cpr, train=train
    )
    return strategy


def _setup(family, infos, **opts) -> tuple[Strategy, dict[str, torch.Tensor]]:
    """ScalableFL set up for `infos`, and its initial global state."""
    strategy = _strategy(family, **opts)
    return strategy, strategy.setup(infos, torch_generator(0, 0, -1, "init"), rounds=10)


def _imagenet() -> ScalableFamily:
    return ScalableFamily(
        {
            "family": "resnet18",
            "input_shape": (3, 256, 256),
            "num_classes": 1000,
            "stem": "imagenet",
        }
    )


def _stage_cnn(side: int = 64, classes: int = 10) -> ScalableFamily:
    return ScalableFamily(
        {"family": "stage-cnn", "input_shape": (1, side, side), "num_classes": classes}
    )


# -- the paper's numbers ---------------------------------------------------------------------------
def test_depth_is_ceil_log2_of_the_input_over_h0() -> None:
    assert [scaled_depth(h, 8) for h in (128, 64, 32)] == [4, 3, 2]  # Fig. 1
    assert [scaled_depth(h, 8) for h, _ in IMAGENET] == [5, 5, 4, 4]  # Table VIII
    assert [scaled_depth(h, 4) for h in (512, 256)] == [7, 6]  # Table IX
    assert scaled_depth(8, 8) == scaled_depth(5, 8) == 1  # at least one stage


def test_imagenet_groups_have_table_iv_widths_and_table_viii_parameters() -> None:
    strategy, state = _setup(_imagenet(), _infos(IMAGENET), base_classes=1000)
    plans = [strategy.assignment.plans[g] for g in IMAGENET]
    assert [p.depth for p in plans] == [5, 5, 4, 4]
    assert [round(p.spec["widths"][0], 2) for p in plans] == [1.0, 0.9, 0.77, 0.67]
    # Table IV: stage1 (stem), stage2..5 output channels; 4-stage clients lack stage5.
    table_iv = [
        (64, 64, 128, 256, 512),
        (58, 58, 116, 231, 461),
        (50, 50, 99, 197),
        (43, 43, 86, 171),
    ]
    for plan, widths in zip(plans, table_iv, strict=True):
        with torch.device("meta"):
            model = strategy.family.build(plan.spec)
        got = [model.stem.out_channels] + [s[-1].conv2.out_channels for s in model.stages]
        assert tuple(got) == widths
    for plan, paper in zip(plans, (11.7e6, 9.31e6, 1.70e6, 1.26e6), strict=True):
        assert abs(plan.params - paper) / paper < 0.02
    # Shared slices are the global model's first c_j stages: 4-stage clients never touch stage5.
    shallow = {e.global_name for e in strategy._index_map_for(plans[3].spec)}
    assert not any(n.startswith("stages.3.") for n in shallow)
    assert any(n.startswith("stages.3.") for n in state)


@pytest.mark.parametrize(
    ("variant", "depth", "paper"),
    [("heterofl-max-1", 4, (2.0, 1.8, 0.77, 0.67)), ("heterofl-max", 5, (1.0, 0.9, 0.38, 0.33))],
)
def test_heterofl_widths_solved_for_imagenet_are_table_viii_ratios(variant, depth, paper) -> None:
    strategy, _ = _setup(_imagenet(), _infos(IMAGENET), base_classes=1000, variant=variant)
    plans = [strategy.assignment.plans[g] for g in IMAGENET]
    assert {p.depth for p in plans} == {depth}
    for plan, ratio in zip(plans, paper, strict=True):
        assert len(set(plan.spec["widths"])) == 1  # one ratio gets within 1 %: no per-stage
        assert abs(plan.spec["widths"][0] - ratio) < 0.01
        assert abs(plan.gap) < 0.01


# -- parameter matching ------------------------------------------------------------------------
def _stage_cnn_count(chans: np.ndarray, cin: int, classes: int) -> np.ndarray:
    """By hand: each stage a 3x3 conv without bias plus BN's weight and bias, then the head."""
    prev = np.full(chans.shape[0], cin)
    total = np.zeros(chans.shape[0], dtype=np.int64)
    for i in range(chans.shape[1]):
        total += 9 * prev * chans[:, i] + 2 * chans[:, i]
        prev = chans[:, i]
    return total + classes * prev + classes


def test_the_quadratic_parameter_count_equals_builds_and_the_hand_count() -> None:
    fam = _stage_cnn()
    spec = fam.normalise({**fam.base, "stages": 3, "num_classes": 5, "input_shape": (1, 32, 32)})
    count = ParameterCount(fam, spec)
    points = np.array([[1, 1, 1], [7, 3, 90], [32, 64, 128], [40, 1, 2]])
    built = [parameter_count(fam, count.spec_at(p)) for p in points]
    assert count(points).tolist() == built == _stage_cnn_count(points, 1, 5).tolist()
    resnet = _imagenet()
    rspec = resnet.normalise({**resnet.base, "stages": 3, "num_classes": 200})
    rcount = ParameterCount(resnet, rspec)
    probe = np.array([[50, 99, 197], [5, 300, 17]])
    assert rcount(probe).tolist() == [parameter_count(resnet, rcount.spec_at(p)) for p in probe]


@pytest.mark.parametrize(
    ("stages", "classes", "target", "max_ratio"),
    [(3, 2, 132, 1.0), (3, 5, 9888, 1.0), (2, 2, 132, 4.0), (2, 10, 94186, 4.0)],
)
def test_parameter_matching_is_the_nearest_achievable(stages, classes, target, max_ratio) -> None:
    """Brute force over every single ratio and every per-stage choice within the spread:
    none comes closer to the target than the match (targets: the FMNIST config's groups)."""
    fam = _stage_cnn()
    spec = fam.normalise({**fam.base, "stages": stages, "num_classes": classes})
    found = match_parameters(fam, spec, target, max_ratio=max_ratio)
    bases = [32, 64, 128, 256][:stages]
    tops = [channels(max_ratio, b) for b in bases]
    ratios = sorted({k / b for b, t in zip(bases, tops, strict=True) for k in range(1, t + 1)})
    single = np.array([[channels(r, b) for b in bases] for r in ratios if r <= max_ratio])
    grid = np.stack(np.meshgrid(*[np.arange(1, t + 1) for t in tops], indexing="ij"), -1)
    grid = grid.reshape(-1, stages)
    r = grid / np.array(bases)
    within = grid[r.max(axis=1) <= 1.5 * r.min(axis=1) + 1e-9]
    best = min(
        np.abs(_stage_cnn_count(single, 1, classes) - target).min(),
        np.abs(_stage_cnn_count(within, 1, classes) - target).min(),
    )
    assert abs(found.params - target) == best
    assert found.params == parameter_count(fam, spec.replace(widths=found.widths))


def test_fmnist_groups_report_their_remaining_gap() -> None:
    infos = _infos(((64, 10), (32, 5), (16, 2)), channels_in=1)
    deep, _ = _setup(_stage_cnn(), infos, variant="heterofl-max")
    # A 3-stage model cannot have 132 parameters: the nearest (1, 2, 4 channels) has 123.
    tiny = deep.assignment.plans[(16, 2)]
    assert (tiny.depth, tiny.params, tiny.target) == (3, 123, 132)
    assert tiny.gap == pytest.approx(-9 / 132)
    assert deep.assignment.plans[(64, 10)].gap == 0.0  # c_max is its own depth: the same model
    assert all(p.depth == 3 for p in deep.assignment.plans.values())
    described = deep.describe()["groups"]["group=16px-2cls"]
    assert (described["params"], described["target"]) == (123, 132)
    assert described["gap"] == round(-9 / 132, 6)


# -- sampling, private layers, errors ----------------------------------------------------------
def test_each_group_samples_max_1_round_xi_n_of_its_clients() -> None:
    fam = _stage_cnn(32)
    groups = ((32, 10), (16, 5), (16, 2))
    kinds = [g for g, n in zip(groups, (20, 16, 2), strict=True) for _ in range(n)]
    infos = [ClientInfo(i, 10, (1, h, h), tuple(range(k))) for i, (h, k) in enumerate(kinds)]
    strategy, _ = _setup(fam, infos, participation=0.2)
    assert [strategy.sampler.quota(g) for g in groups] == [4, 3, 1]  # 4, 3.2 and 0.4
    for rnd in (1, 2):
        chosen = strategy.sampler.sample(rnd, infos, torch_generator(0, rnd, -1, "sample"))
        per_group = [sum(1 for c in chosen if group_key(c) == g) for g in groups]
        assert per_group == [4, 3, 1]
        assert [c.cid for c in chosen] == sorted(c.cid for c in chosen)
    halves, _ = _setup(fam, infos[:20] + infos[36:], participation=0.125)
    assert halves.sampler.quota((32, 10)) == 3 and halves.sampler.quota((16, 2)) == 1  # 2.5 -> 3
    # Without participation, xi = clients_per_round / clients: 19 of 38 -> 10, 8 and 1.
    by_default = _strategy(fam, cpr=19)
    by_default.setup(infos, torch_generator(0, 0, -1, "init"))
    assert [by_default.sampler.quota(g) for g in groups] == [10, 8, 1]


def test_private_parameters_never_leave_the_client() -> None:
    fam = _stage_cnn(32)
    infos = _infos(((32, 4), (16, 2)), channels_in=1)
    strategy, state = _setup(fam, infos, participation=1.0)
    assert not any(".norm." in k or k.startswith("head.") for k in state)
    programs = Programs(fam, seed=0)
    g = torch.Generator().manual_seed(0)
    tasks = strategy.plan(1, state, infos, torch_generator(0, 1, -1, "sample"))
    for task, info in zip(tasks, infos, strict=True):
        side = info.input_shape[1]
        data = ClientData(
            info.cid,
            torch.randn(16, 1, side, side, generator=g),
            torch.arange(16) % len(info.labels),
            torch.randn(4, 1, side, side, generator=g),
            torch.arange(4) % len(info.labels),
            len(info.labels),
        )
        with torch.device("meta"):
            model = fam.build(task.spec)
        private = norm_tensor_names(model) | head_tensor_names(model)
        assert not private & set(task.payload)
        assert task.config.decay_norm_and_bias is False
        program = programs.program_for(info.cid)
        out = program.fit(task, data, {}, torch_generator(0, 1, info.cid, "train"), info=info)
        assert set(out.result.tensors) == set(local_names(task.index_map)) == set(task.payload)
        assert private == set(out.private)  # BN (with running statistics) and head stay


def test_aggregation_weighs_each_client_1_per_element_and_keeps_what_no_one_trained() -> None:
    """One deep client (32 px, 4 classes: 2 stages of 20 and 39 channels) sends 8, three
    shallow ones (16 px, 2 classes: 1 stage of 10 channels) send 1, 2 and 3, with 10 to 40
    samples. Channels 0-9 of stage 0: (8 + 1 + 2 + 3) / 4 = 3.5 (per client, not per group
    or sample); the rest only the deep client's 8. A round of shallow clients alone moves
    channels 0-9 of stage 0 and nothing else."""
    fam = _stage_cnn(32)
    deep = ClientInfo(0, 10, (1, 32, 32), (0, 1, 2, 3))
    shallow = [ClientInfo(c, 10 * (c + 1), (1, 16, 16), (0, 1)) for c in (1, 2, 3)]
    strategy, state = _setup(fam, [deep, *shallow], participation=1.0)

    def round_of(rnd: int, infos: list[ClientInfo], values: dict[int, float]) -> None:
        nonlocal state
        tasks = strategy.plan(rnd, state, infos, torch_generator(0, rnd, -1, "sample"))
        assert sorted(t.cid for t in tasks) == sorted(c.cid for c in infos)
        results = [
            ClientResult(
                t.cid,
                {k: torch.full_like(v, values[t.cid]) for k, v in t.payload.items()},
                num_examples=10 * (t.cid + 1),
                num_steps=1,
                loss=0.0,
            )
            for t in tasks
        ]
        state = strategy.aggregate(rnd, state, trained(tasks, results)).state

    round_of(1, [deep, *shallow], {0: 8.0, 1: 1.0, 2: 2.0, 3: 3.0})
    stage0 = state["stages.0.conv.weight"]
    stage1 = state["stages.1.conv.weight"]
    assert stage0.shape == (20, 1, 3, 3) and stage1.shape == (39, 20, 3, 3)
    assert torch.all(stage0[:10] == 3.5) and torch.all(stage0[10:] == 8.0)
    assert torch.all(stage1 == 8.0)
    round_of(2, shallow, {1: 5.0, 2: 5.0, 3: 5.0})
    after = state
    assert torch.all(after["stages.0.conv.weight"][:10] == 5.0)
    assert torch.equal(after["stages.0.conv.weight"][10:], stage0[10:])
    assert torch.equal(after["stages.1.conv.weight"], stage1)  # no shallow client reaches it


def test_individual_training_shares_nothing() -> None:
    fam = _stage_cnn(32)
    infos = _infos(((32, 4), (16, 2)), channels_in=1)
    strategy, state = _setup(fam, infos, variant="individual")
    assert state == {}
    task = strategy.plan(1, state, infos, torch_generator(0, 1, -1, "sample"))[0]
    assert task.payload == {} and task.index_map == []
    assert strategy.eval_task(infos[1], state, {}).group == "group=16px-2cls"


def test_a_one_class_client_is_refused_by_name() -> None:
    fam = _stage_cnn(32)
    infos = [*_infos(((32, 4),), channels_in=1), ClientInfo(7, 10, (1, 32, 32), (0,))]
    with pytest.raises(ValueError, match="client 7 has 1 class"):
        _setup(fam, infos)
    with pytest.raises(ValueError, match=r"client 3: scalablefl needs labels 0\.\.K-1"):
        _setup(fam, [ClientInfo(3, 10, (1, 32, 32), (2, 5))])


def test_learning_rate_decays_along_a_cosine_over_the_rounds() -> None:
    """Table VIII's schedule through the shared `train.lr_schedule`, with ScalableFL's own
    setting (no decay on norms and biases) still in the task."""
    fam, infos = _stage_cnn(32), _infos(((32, 4),), channels_in=1)
    strategy = _strategy(fam, train=replace(TRAIN, lr_schedule=LrSchedule("cosine")))
    strategy.setup(infos, torch_generator(0, 0, -1, "init"), rounds=10)
    configs = [strategy._task_config(r, infos[0]) for r in (1, 6)]  # of 10 rounds
    assert [c.lr for c in configs] == pytest.approx([0.1, 0.05])
    assert all(c.decay_norm_and_bias is False for c in configs)
    assert _setup(fam, infos)[0]._task_config(6, infos[0]).lr == 0.1


def test_weight_decay_spares_norms_and_biases_when_asked() -> None:
    """A zero loss leaves only the decay: w <- w (1 - lr * wd) for conv and linear weights."""
    fam = _stage_cnn(16)
    spec = fam.normalise({**fam.base, "stages": 1, "input_shape": (1, 16, 16), "num_classes": 3})

    def zero(model, x, y, ctx):
        out = model(x)
        return out, out.sum(dim=1) * 0.0

    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 0])
    data = ClientData(0, x, y, x, y, num_classes=3)
    for decay_all in (True, False):
        model = initialize(fam.build(spec), torch.Generator().manual_seed(0))
        with torch.no_grad():
            model.stages[0].norm.weight.fill_(2.0)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        settings = LocalTraining(
            lr=0.5, steps=1, batch_size=4, weight_decay=0.1, decay_norm_and_bias=decay_all
        )
        task = ClientTask(0, spec, {}, [])
        params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
        buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
        ctx = TrainContext(
            task, {}, torch.Generator().manual_seed(0), settings, params=params, buffers=buffers
        )
        train_local(model, data, LocalRecipe(forward=zero), ctx)
        after = {k: v.detach() for k, v in params.items()}
        shrink = 1 - 0.5 * 0.1
        for name in ("stages.0.conv.weight", "head.weight"):
            assert torch.allclose(after[name], before[name] * shrink)
        for name in ("stages.0.norm.weight", "head.bias"):
            expected = before[name] * shrink if decay_all else before[name]
            assert torch.allclose(after[name], expected), (decay_all, name)


# -- client views -----------------------------------------------------------------------------
def test_resizing_is_bilinear_with_antialiasing_by_hand() -> None:
    ramp = torch.arange(4.0).repeat(4, 1)[None, None]  # columns 0, 1, 2, 3
    # Down by 2: a triangle filter twice as wide, centred at 0.5 and 2.5, over 0..3:
    # weights 3/7, 3/7, 1/7 -> (0 + 3 + 2) / 7 and (1 + 6 + 9) / 7.
    assert torch.allclose(resize_images(ramp, 2), torch.tensor([[5 / 7, 16 / 7]] * 2))
    flat = torch.full((2, 3, 5, 5), 0.25)
    assert torch.equal(resize_images(flat, 13), torch.full((2, 3, 13, 13), 0.25))
    assert resize_images(ramp, None) is ramp and resize_images(ramp, 4) is ramp


def test_remapping_and_class_subsets_by_hand() -> None:
    assert remap_labels(torch.tensor([3, 7, 3, 9]), (3, 7, 9)).tolist() == [0, 1, 0, 2]
    with pytest.raises(ValueError, match="outside the view's classes"):
        remap_labels(torch.tensor([4]), (3, 7))
    groups = [ViewGroup(clients=2, size=8, classes=3), ViewGroup(clients=1, classes=None)]
    views = draw_views(groups, num_classes=10, seed=5)
    assert [v.size for v in views] == [8, 8, None]
    for v in views[:2]:
        assert len(v.classes) == 3 and list(v.classes) == sorted(set(v.classes))
    assert views[2].classes is None
    # A client's draw depends on (seed, client id) only, not on the groups after it.
    assert draw_views(groups[:1], 10, seed=5) == views[:2]
    assert draw_views(groups, 10, seed=6) != views


def test_class_subsets_come_from_the_classes_a_partition_holds() -> None:
    """On a label-skewed partition each client's K classes are drawn among its own; when
    a client holds every class the draw is the one without `held`."""
    groups = [ViewGroup(clients=3, classes=2)]
    held = [[1, 4, 6], list(range(10)), [2, 3]]
    views = draw_views(groups, 10, seed=5, held=held)
    for v, h in zip(views, held, strict=True):
        assert set(v.classes) <= set(h) and len(v.classes) == 2
    assert views[2].classes == (2, 3)
    assert views[1] == draw_views(groups, 10, seed=5)[1]
    with pytest.raises(ValueError, match=r"client 2's partition holds 2 classes \[2, 3\]"):
        draw_views([ViewGroup(clients=3, classes=3)], 10, seed=5, held=held)


def test_scalablefl_runs_on_a_label_skewed_partition(tmp_path) -> None:
    """Groups on top of Dirichlet(0.3) label skew: every client's K classes are among its
    own, so the federation builds and each client's labels are exactly 0..K-1."""
    cfg = validate(
        {
            "data": {
                "dataset": "digits",
                "partition": {"kind": "dirichlet", "alpha": 0.3},
                "test_per_client": 10,
                "groups": [{"size": 8, "classes": 3, "clients": 4}],
            },
            "train": {"clients_per_round": 4},
            "device": "cpu",
        }
    )
    fed = build_federation(cfg, torch.device("cpu"))
    assert all(c.info().labels == (0, 1, 2) for c in fed.clients)


def test_a_view_restricts_remaps_and_resizes_a_client() -> None:
    """Five classes, sample i has label i % 5 and every pixel equal to i."""
    n = 40
    x = np.repeat(np.arange(n, dtype=np.float32), 16).reshape(n, 1, 4, 4)
    y = np.arange(n, dtype=np.int64) % 5
    ds = Dataset("tiny", x, y, x.copy(), y.copy(), num_classes=5)
    parts = [np.arange(0, 20), np.arange(20, 40)]
    views = [ClientView(size=2, classes=(1, 3), samples=3), ClientView()]
    a, b = build_clients(ds, parts, test_per_client=4, seed=0, views=views)
    assert a.x_train.shape == (3, 1, 2, 2) and a.x_test.shape == (4, 1, 2, 2)
    originals = a.x_train[:, 0, 0, 0].long()  # a constant image stays constant when resized
    assert set((originals % 5).tolist()) == {1, 3} and set(originals.tolist()) <= set(range(20))
    assert a.y_train.tolist() == [(int(o) % 5 == 3) * 1 for o in originals]
    assert set(a.y_test.tolist()) <= {0, 1} and a.labels == (0, 1) and a.num_classes == 2
    assert (a.x_test[:, 0, 0, 0].long() % 5 == torch.tensor([1, 3])[a.y_test]).all()
    assert b.x_train.shape == (20, 1, 4, 4) and b.labels == (0, 1, 2, 3, 4)
    with pytest.raises(ValueError, match="client 0 holds 8 training samples"):
        build_clients(ds, parts, 0, seed=0, views=[ClientView(classes=(1, 3), samples=9)] * 2)


def test_groups_set_num_clients_and_are_checked_at_the_edge() -> None:
    base = {
        "algorithm": "scalablefl",
        "model": {"name": "stage-cnn"},
        "train": {"clients_per_round": 2},
        "data": {"groups": [{"size": 32, "classes": 4, "clients": 2}, {"size": 16, "clients": 3}]},
    }
    assert validate(base).data.num_clients == 5
    with pytest.raises(ConfigError, match="num_clients = 4 but groups hold 5"):
        validate({**base, "data": {**base["data"], "num_clients": 4}})
    with pytest.raises(ConfigError, match="takes one input size"):
        validate({**base, "algorithm": "fedavg", "model": {"name": "small-cnn"}})
    with pytest.raises(ConfigError, match="variant"):
        validate({**base, "options": {"scalablefl": {"variant": "heterofl"}}})


def test_the_fashion_mnist_sweep_config_validates() -> None:
    path = Path(__file__).resolve().parents[1] / "configs" / "scalablefl_fmnist.yaml"
    points = expand_sweep(load_raw(path))
    configs = [validate(raw) for _, raw in points]
    variants = {c.options["scalablefl"]["variant"] for c in configs}
    assert variants == {"scalablefl", "heterofl-max", "heterofl-max-1", "individual"}
    assert sorted({c.seed for c in configs}) == [0, 1, 2] and len(configs) == 12
    assert all(c.data.num_clients == 9 for c in configs)


# -- end to end ---------------------------------------------------------------------------------
def test_scalablefl_learns_digits_through_client_views(tmp_path) -> None:
    ds = load_digits(seed=0)
    parts = PARTITIONERS.get("iid")(ds.y_train, 6, np.random.default_rng(0))
    groups = [ViewGroup(3, size=16, classes=10), ViewGroup(3, size=8, classes=3)]
    views = draw_views(groups, ds.num_classes, seed=0)
    clients = build_clients(ds, parts, test_per_client=40, seed=0, views=views)
    fam = ScalableFamily({"family": "stage-cnn", "input_shape": (1, 16, 16), "num_classes": 10})
    strategy, recipe = ALGORITHMS.get("scalablefl").build(
        fam,
        {"base_size": 2, "participation": 1.0},
        clients_per_round=6,
        train=LocalTraining(lr=0.1, steps=10, batch_size=16, momentum=0.9, weight_decay=5e-4),
    )
    settings = RoundSettings(rounds=4, seed=0, local_eval="all")
    sim = Simulation(
        strategy, Programs(fam, recipe, seed=0), clients, global_test(ds), settings, tmp_path
    )
    summary = sim.run()
    row = sim.metrics.read()[-1]
    assert row["global_acc"] is None
    # The groups' models are in summary.json, as set-up decided them.
    written = json.loads((tmp_path / "summary.json").read_text())["strategy"]
    assert written == summary["strategy"] and written["variant"] == "scalablefl"
    models = written["groups"]
    assert [models[g]["depth"] for g in ("group=16px-10cls", "group=8px-3cls")] == [3, 2]
    assert models["group=8px-3cls"]["widths"][0] == pytest.approx(math.log10(3))
    assert all(m["params"] == m["target"] and m["gap"] == 0 for m in models.values())
    assert set(row["groups"]) == {"group=16px-10cls", "group=8px-3cls"}
    assert [p.depth for p in strategy.assignment.plans.values()] == [
        2,
        3,
    ]  # 8 px: 2, 16 px: 3 stages
    assert row["groups"]["group=16px-10cls"]["acc"] > 0.5  # chance is 0.1
    assert row["groups"]["group=8px-3cls"]["acc"] > 0.6  # chance is 1/3
    assert row["local_acc"] == pytest.approx(
        sum(g["acc"] * g["n"] for g in row["groups"].values()) / 6
    )
    assert math.isfinite(row["loss"])


def test_heterofl_below_c_max_needs_a_depth_left() -> None:
    infos = _infos(((8, 10), (8, 5)), channels_in=1)  # every group at c = 1
    with pytest.raises(ValueError, match=r"c_max - 1 needs c_max > 1, got c_max = 1"):
        _setup(_stage_cnn(16), infos, variant="heterofl-max-1")
    shallow, _ = _setup(_stage_cnn(16), infos, variant="heterofl-max")
    assert [p.depth for p in shallow.assignment.plans.values()] == [1, 1]


def test_the_regime_check_narrows_resnet18_by_model_width() -> None:
    """configs/scalablefl_regime_fmnist.yaml: Fashion-MNIST groups at 28/20/14 px with
    10/5/3 classes, H0 = 7, the small-stem ResNet-18 at a quarter of its widths (16, 32,
    64, 128). Halvings ceil(log2(H / 7)) = 2, 2, 1, so stages 3, 3, 2 (the stem and stage 1
    keep the side; each later stage halves it): 28 -> 7, 20 -> 5, 14 -> 7 px. Channels are
    ceil(kappa / 4 * base) with kappa = 1, log10 5, log10 3 (K0 = 10)."""
    fam = ScalableFamily(
        {"family": "resnet18", "input_shape": (1, 28, 28), "num_classes": 10, "width": 0.25}
    )
    groups = ((28, 10), (20, 5), (14, 3))
    strategy, _ = _setup(fam, _infos(groups, channels_in=1), base_size=7)
    plans = [strategy.assignment.plans[g] for g in groups]
    assert [p.depth for p in plans] == [2, 2, 1]
    assert [p.spec["stages"] for p in plans] == [3, 3, 2]
    expected = [(16, 32, 64), (12, 23, 45), (8, 16)]
    for plan, widths, (_, k) in zip(plans, expected, groups, strict=True):
        assert plan.spec["widths"][0] == pytest.approx(math.log10(k) / 4)
        with torch.device("meta"):
            model = strategy.family.build(plan.spec)
        assert tuple(s[-1].conv2.out_channels for s in model.stages) == widths
        assert len(model.stages[-1]) == 2  # two blocks, four 3x3 convolutions, per stage
    low, _ = _setup(fam, _infos(groups, channels_in=1), base_size=7, variant="heterofl-max-1")
    assert {p.spec["stages"] for p in low.assignment.plans.values()} == {2}
