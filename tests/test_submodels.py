"""Scalable families, slicing, BatchNorm modes, HeteroFL, FjORD, FedBN and FedPer.

Hand computations: index maps of width and depth slices, element-wise averages of
overlapping sub-models, label-split head rows. Equivalences: a model built at width p
equals a wider one run at p; a width-1.0 sub-model is the global model; extract then
aggregate of unchanged sub-models gives the global state back bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.submodels import assign_in_proportion
from hetfl.core.client import ClientProgram, mask_logits
from hetfl.core.init import initialize
from hetfl.core.rng import torch_generator
from hetfl.core.spec import group_qualified, prefix_index
from hetfl.core.state import Accumulator, extract
from hetfl.core.types import ClientInfo, ClientResult
from hetfl.data import PARTITIONERS, build_clients, global_test, load_digits
from hetfl.engine.rounds import RoundSettings
from hetfl.models import ScalableFamily, SpecError, make_family
from hetfl.models.slim import channels
from hetfl.sim import Simulation

FAMILIES = {
    "stage-cnn": (3, 16, 16),
    "flanc-cnn": (1, 12, 12),
    "resnet18": (3, 8, 8),
    "preresnet": (3, 8, 8),
}
TRAIN = {"lr": 0.05, "epochs": 1, "batch_size": 16}


def _family(name: str, **base) -> ScalableFamily:
    return ScalableFamily(
        {"family": name, "input_shape": FAMILIES[name], "num_classes": 10, **base}
    )


def _global(family: ScalableFamily, seed: int = 0) -> dict[str, torch.Tensor]:
    model = initialize(family.build(family.global_spec([])), torch.Generator().manual_seed(seed))
    return dict(model.state_dict())


# -- widths, channels and index maps ----------------------------------------------------------
def test_channels_use_ceil_as_scalablefl_table_iv() -> None:
    assert channels(0.8997, 128) == 116 and channels(0.8997, 256) == 231
    assert channels(0.7670, 64) == 50 and channels(0.6667, 256) == 171
    assert channels(0.3, 10) == 3  # 0.3 * 10 is 3.0000000000000004 in floating point
    assert channels(0.01, 10) == 1  # never below one channel
    assert channels(2.0, 32) == 64  # ratios may exceed 1


def test_stage_cnn_index_map_by_hand() -> None:
    fam = _family("stage-cnn")
    spec = fam.normalise({**fam.base, "widths": (0.5, 0.25, 1.0, 1.0), "stages": 2})
    imap = {e.local: e for e in fam.index_map(spec)}
    # Depth: only the first two stages exist; width: 32*0.5 = 16 and 64*0.25 = 16 channels.
    assert sorted({k.split(".")[1] for k in imap if k.startswith("stages.")}) == ["0", "1"]
    assert imap["stages.0.conv.weight"].index == prefix_index(16, 3, 3, 3)
    assert imap["stages.1.conv.weight"].index == prefix_index(16, 16, 3, 3)
    assert imap["stages.1.norm.running_mean"].index == prefix_index(16)
    assert imap["head.weight"].index == prefix_index(10, 16)
    state = _global(fam)
    assert state["stages.1.conv.weight"].shape == (64, 32, 3, 3)
    part = extract(state, list(imap.values()))
    assert torch.equal(part["stages.1.conv.weight"], state["stages.1.conv.weight"][:16, :16])


def test_resnet_depth_slicing_keeps_the_first_blocks_of_each_stage() -> None:
    fam = _family("preresnet", blocks=(2, 2, 2, 2))
    spec = fam.normalise({**fam.base, "blocks": (1, 2, 1, 1), "stages": 3, "width": 0.5})
    names = {e.local for e in fam.index_map(spec)}
    assert "stages.0.0.conv1.weight" in names and "stages.0.1.conv1.weight" not in names
    assert "stages.1.1.conv2.weight" in names and not any(n.startswith("stages.3") for n in names)
    entry = next(e for e in fam.index_map(spec) if e.local == "stages.1.0.shortcut.weight")
    assert entry.index == prefix_index(64, 32, 1, 1)  # 128 * 0.5 out, 64 * 0.5 in
    # The global spec is the per-slot maximum over the specs that have the slot.
    shallow_wide = fam.normalise({**fam.base, "stages": 1, "width": 1.0})
    deep_narrow = fam.normalise({**fam.base, "stages": 4, "width": 0.25})
    merged = fam.global_spec([shallow_wide, deep_narrow])
    assert merged["stages"] == 4 and merged["widths"] == (1.0, 0.25, 0.25, 0.25)


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("bn", ["batch", "static", "per-width", "none"])
def test_model_built_at_p_equals_wider_model_run_at_p(name: str, bn: str) -> None:
    fam = _family(name, bn=bn, levels=(0.25, 0.5, 1.0))
    state = _global(fam)
    wide = fam.build(fam.global_spec([]))
    wide.load_state_dict(state)
    spec = fam.normalise({**fam.base, "width": 0.5})
    narrow = fam.build(spec)
    narrow.load_state_dict(extract(state, fam.index_map(spec)))
    x = torch.randn(4, *FAMILIES[name], generator=torch.Generator().manual_seed(1))
    for mode in ("train", "eval"):
        wide.train(mode == "train")
        narrow.train(mode == "train")
        with torch.no_grad():
            assert torch.equal(wide(x, width=0.5), narrow(x)), mode


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_width_one_sub_model_is_the_global_model(name: str) -> None:
    fam = _family(name)
    state = _global(fam)
    spec = fam.normalise({**fam.base, "width": 1.0})
    assert spec == fam.global_spec([])
    sub = fam.build(spec)
    sub.load_state_dict(extract(state, fam.index_map(spec)))
    ref = fam.build(fam.global_spec([]))
    ref.load_state_dict(state)
    x = torch.randn(3, *FAMILIES[name], generator=torch.Generator().manual_seed(2))
    sub.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.equal(sub(x), ref(x))


def test_flanc_cnn_macs_match_flanc_table_2() -> None:
    """17/37/60/88 M MACs at p = 0.25/0.5/0.75/1 on 28x28 (METHODS.md §3.1)."""
    from torch.utils.flop_counter import FlopCounterMode

    fam = ScalableFamily({"family": "flanc-cnn", "input_shape": (1, 28, 28), "num_classes": 10})
    got = []
    for p in (0.25, 0.5, 0.75, 1.0):
        model = fam.build(fam.normalise({**fam.base, "width": p})).eval()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(torch.zeros(1, 1, 28, 28))
        got.append(counter.get_total_flops() / 2 / 1e6)
    for mine, paper in zip(got, (17, 37, 60, 88), strict=True):
        assert abs(mine - paper) / paper < 0.05, got


# -- aggregation ---------------------------------------------------------------------------------
def test_unchanged_sub_models_aggregate_to_the_global_state_bit_for_bit() -> None:
    fam = _family("preresnet", bn="static")
    state = _global(fam)
    acc = Accumulator(state)
    for p in (1.0, 0.5, 0.25, 0.125):
        imap = fam.index_map(fam.normalise({**fam.base, "width": p, "bn": "static"}))
        acc.add(extract(state, imap), imap, weight=1.0)
    out = acc.result(state, fill="keep")
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_overlapping_sub_models_average_element_wise_with_their_weights() -> None:
    fam = _family("stage-cnn", stages=1)
    state = _global(fam)
    name = "stages.0.conv.weight"  # global (32, 3, 3, 3)
    maps = {p: fam.index_map(fam.normalise({**fam.base, "width": p})) for p in (1.0, 0.5)}
    wide = {k: torch.full_like(v, 2.0) for k, v in extract(state, maps[1.0]).items()}
    narrow = {k: torch.full_like(v, 8.0) for k, v in extract(state, maps[0.5]).items()}
    acc = Accumulator(state)
    acc.add(wide, maps[1.0], weight=1.0)
    acc.add(narrow, maps[0.5], weight=3.0)
    out = acc.result(state, fill="keep")[name]
    # Channels 0..15 are covered by both: (1 * 2 + 3 * 8) / 4 = 6.5; 16..31 by the wide one.
    assert torch.all(out[:16] == 6.5) and torch.all(out[16:] == 2.0)


def _plan(name: str, family, infos, **opts):
    strategy, hooks = ALGORITHMS.get(name).build(
        family, opts, clients_per_round=len(infos), train=TRAIN
    )
    strategy.setup(infos, torch_generator(0, 0, -1, "init"))
    tasks = strategy.plan(1, infos, torch_generator(0, 1, -1, "sample"))
    return strategy, hooks, tasks


def test_label_split_head_rows_come_only_from_clients_holding_the_class() -> None:
    fam = _family("stage-cnn", stages=1)
    infos = [ClientInfo(0, 50, (3, 16, 16), (0, 1)), ClientInfo(1, 50, (3, 16, 16), (1, 2))]
    strategy, _, tasks = _plan("heterofl", fam, infos, levels=(1.0,))
    before = dict(strategy.global_state)
    results = []
    for task, value in zip(tasks, (1.0, 5.0), strict=True):
        tensors = {k: torch.full_like(v, value) for k, v in task.payload.items()}
        results.append(ClientResult(task.cid, tensors, 50, 1, 0.0))
    after = strategy.aggregate(1, results, [])
    head = after["head.weight"]
    assert torch.all(head[0] == 1.0) and torch.all(head[2] == 5.0)  # only their holder
    assert torch.all(head[1] == 3.0)  # both hold class 1: uniform weights
    assert torch.equal(head[3:], before["head.weight"][3:])  # nobody holds them: kept
    assert torch.equal(after["head.bias"][3:], before["head.bias"][3:])
    assert torch.all(after["stages.0.conv.weight"] == 3.0)  # body: plain uniform average


def test_mask_logits_zeroes_absent_classes() -> None:
    out = mask_logits(torch.tensor([[1.0, -2.0, 3.0]]), (0, 2))
    assert out.tolist() == [[1.0, 0.0, 3.0]]


def test_fixed_assignment_uses_exact_proportions_in_id_order() -> None:
    got = assign_in_proportion(range(10), (1.0, 0.5), (0.7, 0.3))
    assert [got[c] for c in range(10)] == [1.0] * 7 + [0.5] * 3
    equal = assign_in_proportion(range(100), (0.25, 0.5, 0.75, 1.0), None)
    assert sorted(list(equal.values()).count(p) for p in (0.25, 0.5, 0.75, 1.0)) == [25] * 4


# -- BatchNorm modes and private layers ----------------------------------------------------------
def test_per_width_statistics_stay_per_width() -> None:
    fam = _family("stage-cnn", stages=1, bn="per-width", levels=(0.5, 1.0))
    model = fam.build(fam.global_spec([]))
    initialize(model, torch.Generator().manual_seed(0))
    norm = model.stages[0].norm
    before_half = norm.running_mean_w0p5.clone()
    model.train()
    model(torch.randn(8, 3, 16, 16), width=1.0)
    assert torch.equal(norm.running_mean_w0p5, before_half)  # width 1 leaves 0.5's alone
    assert not torch.equal(norm.running_mean_w1, torch.zeros(32))
    touched = norm.running_mean_w1.clone()
    model(torch.randn(8, 3, 16, 16), width=0.5)
    assert torch.equal(norm.running_mean_w1, touched)
    assert not torch.equal(norm.running_mean_w0p5, before_half)


def test_static_bn_has_no_running_statistics_and_the_scaler_acts_in_training_only() -> None:
    fam = _family("stage-cnn", stages=1)
    spec = fam.normalise({**fam.base, "width": 0.5, "bn": "static", "scaler": True})
    model = fam.build(spec)
    assert not any("running" in k for k in model.state_dict())
    norm = model.stages[0].norm
    x = torch.randn(4, 16, 5, 5)
    norm.train()
    ref = torch.nn.functional.batch_norm(x / 0.5, None, None, norm.weight, norm.bias, True)
    assert torch.allclose(norm(x), ref)
    norm.eval()
    assert torch.allclose(
        norm(x), torch.nn.functional.batch_norm(x, None, None, norm.weight, norm.bias, True)
    )


@pytest.mark.parametrize("algorithm", ["fedbn", "fedper"])
def test_private_tensors_stay_out_of_the_global_state(algorithm: str) -> None:
    fam = _family("stage-cnn", stages=2)
    infos = [ClientInfo(c, 30, (3, 16, 16), tuple(range(10))) for c in range(2)]
    strategy, _, tasks = _plan(algorithm, fam, infos)
    private = {"fedbn": ".norm.", "fedper": "head."}[algorithm]
    assert not any(private in k for k in strategy.global_state)
    assert all(not any(private in k for k in t.payload) for t in tasks)
    assert strategy.eval_models(strategy.global_state) == []  # no complete global model


def test_fedbn_refuses_a_model_without_normalisation() -> None:
    fam = make_family("mlp", (1, 8, 8), 10)
    with pytest.raises(ValueError, match="needs normalisation layers"):
        _plan("fedbn", fam, [ClientInfo(0, 10, (1, 8, 8), (0,))])


def test_group_qualified_entries_start_from_the_shared_tensor() -> None:
    fam = _family("stage-cnn", stages=1)
    imap = fam.index_map(fam.global_spec([]))
    norms = [e.local for e in imap if ".norm." in e.local]
    grouped = group_qualified(imap, "p=1", norms)
    assert {e.global_name for e in grouped if e.local in norms} == {f"p=1/{n}" for n in norms}
    with pytest.raises(ValueError, match="must not contain"):
        group_qualified(imap, "a/b", norms)


# -- bad specs ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"width": 0.0}, "positive finite"),
        ({"width": -0.5}, "positive finite"),
        ({"width": math.nan}, "positive finite"),
        ({"width": math.inf}, "positive finite"),
        ({"stages": 5}, "stages must be"),
        ({"input_shape": (3, 8, 8), "stages": 4}, "too small for 4 stage"),
        ({"bn": "group"}, "bn must be one of"),
        ({"widths": (1.0, 1.0)}, "needs 4 values"),
    ],
)
def test_bad_specs_fail_with_clear_errors(change: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        ScalableFamily(
            {"family": "stage-cnn", "input_shape": (3, 16, 16), "num_classes": 10, **change}
        )


def test_more_classes_than_the_data_has_is_refused() -> None:
    fam = _family("stage-cnn")
    with pytest.raises(SpecError, match="12 classes, but the data has 10"):
        fam.build(fam.base.replace(num_classes=12))


def test_plain_models_refuse_scalable_options() -> None:
    with pytest.raises(ValueError, match="one fixed architecture"):
        make_family("mlp", (1, 8, 8), 10, width=0.5)
    with pytest.raises(ValueError, match="scalable model"):
        ALGORITHMS.get("heterofl").build(
            make_family("mlp", (1, 8, 8), 10), {}, clients_per_round=1, train=TRAIN
        )


# -- end to end on real data ---------------------------------------------------------------------
def _digits_sim(algorithm: str, tmp_path, **opts) -> Simulation:
    ds = load_digits(seed=0)
    parts = PARTITIONERS.get("classes")(ds.y_train, 8, np.random.default_rng(0), k=4)
    clients = build_clients(ds, parts, test_per_client=30, seed=0)
    fam = ScalableFamily(
        {"family": "stage-cnn", "input_shape": ds.input_shape, "num_classes": 10, "stages": 3}
    )
    strategy, hooks = ALGORITHMS.get(algorithm).build(
        fam,
        opts,
        clients_per_round=8,
        train={"lr": 0.1, "epochs": 1, "batch_size": 16, "momentum": 0.5},
    )
    settings = RoundSettings(rounds=4, seed=0, stats_samples=500)
    program = ClientProgram(fam, hooks, seed=0)
    return Simulation(strategy, program, clients, global_test(ds, "cpu"), settings, tmp_path)


@pytest.mark.parametrize(
    ("algorithm", "opts"),
    [
        ("heterofl", {"levels": (1.0, 0.5, 0.25)}),
        ("fjord", {"levels": (0.25, 0.5, 1.0), "distill": True}),
    ],
)
def test_width_methods_learn_digits_and_report_every_width(algorithm, opts, tmp_path) -> None:
    sim = _digits_sim(algorithm, tmp_path, **opts)
    summary = sim.run()
    rows = sim.metrics.read()
    assert rows[-1]["global_acc"] > max(0.5, rows[0]["global_acc"])  # chance is 0.1
    assert set(rows[-1]["groups"]) >= {"width=1", "width=0.5", "width=0.25"}
    assert rows[-1]["groups"]["width=0.25"]["acc"] > 0.3
    assert rows[-1]["local_acc"] is not None
    assert summary["final"]["global_acc"] == rows[-1]["global_acc"]


def test_fjord_records_one_pass_per_step_at_the_drawn_width(tmp_path) -> None:
    sim = _digits_sim("fjord", tmp_path, levels=(0.25, 0.5, 1.0))
    sim.setup()
    info = sim.infos[7]  # the last client in id order holds the widest tier
    task = sim.strategy.plan(1, [info], torch_generator(0, 1, -1, "sample"))[0]
    data = sim.clients[7]
    out = sim.program.fit(task, data, {}, torch_generator(0, 1, 7, "train"), info=info)
    widths = {r.width for r in out.result.passes}
    assert widths <= {0.25, 0.5, 1.0} and len(widths) > 1
    assert sum(r.count for r in out.result.passes) == out.result.num_steps
