"""Scalable families, slicing, BatchNorm modes, HeteroFL, FjORD, FedBN and FedPer.

Hand computations: index maps of width and depth slices, element-wise averages of
overlapping sub-models, label-split head rows. Equivalences: a model built at width p
equals a wider one run at p; a width-1.0 sub-model is the global model; extract then
aggregate of unchanged sub-models gives the global state back bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.fjord import OrderedDropout
from hetfl.algorithms.parts.width_assignment import assign_in_proportion
from hetfl.algorithms.parts.width_eval import eval_model_at
from hetfl.config import ConfigError, validate
from hetfl.core.client.bn_statistics import recompute_bn_statistics
from hetfl.core.client.program import Programs
from hetfl.core.client.recipe import TrainContext
from hetfl.core.client.scoring import evaluate_model
from hetfl.core.client.terms import mask_logits
from hetfl.core.init import initialize
from hetfl.core.model_cache import ModelCache
from hetfl.core.rng import torch_generator
from hetfl.core.server.evaluation import LocalModel
from hetfl.core.spec import Spec, group_qualified, prefix_index
from hetfl.core.state import Accumulator, extract
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, ClientInfo, ClientResult, ClientTask, EvalTask
from hetfl.data import PARTITIONERS, build_clients, global_test, load_digits
from hetfl.engine.round_settings import RoundSettings
from hetfl.models import ScalableFamily, SpecError, make_family
from hetfl.models.slim import channels
from hetfl.runner import build_simulation, start_banner
from hetfl.sim import Simulation
from strategies import trained

FAMILIES = {
    "stage-cnn": (3, 16, 16),
    "flanc-cnn": (1, 12, 12),
    "resnet18": (3, 8, 8),
    "preresnet": (3, 8, 8),
    "mobilenetv2": (3, 8, 8),
    "efficientnetv2-tiny": (3, 8, 8),
}
TRAIN = LocalTraining(lr=0.05, epochs=1, batch_size=16)


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
    strategy, recipe = ALGORITHMS.get(name).build(
        family, opts, clients_per_round=len(infos), train=TRAIN
    )
    state = strategy.setup(infos, torch_generator(0, 0, -1, "init"))
    tasks = strategy.plan(1, state, infos, torch_generator(0, 1, -1, "sample"))
    return strategy, recipe, tasks, state


def test_label_split_head_rows_come_only_from_clients_holding_the_class() -> None:
    fam = _family("stage-cnn", stages=1)
    infos = [ClientInfo(0, 50, (3, 16, 16), (0, 1)), ClientInfo(1, 50, (3, 16, 16), (1, 2))]
    strategy, _, tasks, state = _plan("heterofl", fam, infos, levels=(1.0,))
    before = dict(state)
    results = []
    for task, value in zip(tasks, (1.0, 5.0), strict=True):
        tensors = {k: torch.full_like(v, value) for k, v in task.payload.items()}
        results.append(ClientResult(task.cid, tensors, 50, 1, 0.0))
    after = strategy.aggregate(1, state, trained(tasks, results)).state
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
    strategy, recipe = ALGORITHMS.get(algorithm).build(
        fam,
        opts,
        clients_per_round=8,
        train=LocalTraining(lr=0.1, epochs=1, batch_size=16, momentum=0.5),
    )
    settings = RoundSettings(rounds=4, seed=0, stats_samples=500)
    program = Programs(fam, recipe, seed=0)
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
    task = sim.strategy.plan(1, sim.state, [info], torch_generator(0, 1, -1, "sample"))[0]
    data = sim.clients[7]
    program = sim.programs.program_for(7)
    out = program.fit(task, data, {}, torch_generator(0, 1, 7, "train"), info=info)
    widths = {r.width for r in out.result.passes}
    assert widths <= {0.25, 0.5, 1.0} and len(widths) > 1
    assert sum(r.count for r in out.result.passes) == out.result.num_steps


# -- HeteroFL's local accuracy ---------------------------------------------------------------------
def _heterofl_digits(tmp_path, **opts) -> Simulation:
    """4 digits clients of 3 classes each, all sampled, levels 1 and 1/2, one short round."""
    ds = load_digits(seed=0)
    parts = PARTITIONERS.get("classes")(ds.y_train, 4, np.random.default_rng(0), k=3)
    clients = build_clients(ds, parts, test_per_client=30, seed=0)
    fam = ScalableFamily(
        {"family": "stage-cnn", "input_shape": ds.input_shape, "num_classes": 10, "stages": 2}
    )
    strategy, recipe = ALGORITHMS.get("heterofl").build(
        fam,
        {"levels": (1.0, 0.5), **opts},
        clients_per_round=4,
        train=LocalTraining(lr=0.1, steps=4, batch_size=16),
    )
    settings = RoundSettings(rounds=1, seed=0)
    program = Programs(fam, recipe, seed=0)
    return Simulation(strategy, program, clients, global_test(ds, "cpu"), settings, tmp_path)


def _masked_accuracy(model, data) -> float:
    correct, _, n = evaluate_model(model, data.x_test, data.y_test, label_mask=data.labels)
    return correct / n


def test_heterofl_local_acc_is_the_full_rate_model_with_each_clients_label_mask(tmp_path):
    """The authors' local accuracy (train_classifier_fed.py: `stats`, then `test` with each
    client's label split), the default: the full-rate model with the statistics of the
    global evaluation (every client's training data), logits masked to the client's
    classes, averaged over the clients; no per-level local groups."""
    sim = _heterofl_digits(tmp_path)
    sim.run()
    row = sim.metrics.read()[-1]
    full = sim.strategy.eval_models(sim.state)[0]
    assert full.name == "width=1"
    model = sim.programs.family.build(full.spec)
    model.load_state_dict(full.tensors)
    sim.stats_pass(1, model, full)
    expected = [_masked_accuracy(model, sim.clients[c]) for c in sorted(sim.clients)]
    assert row["local_acc"] == pytest.approx(sum(expected) / len(expected), abs=1e-12)
    assert not any(g.startswith("local") for g in row["groups"])
    assert sim.info["strategy"]["local_eval_model"] == "global-masked"


def test_heterofl_own_level_judges_each_clients_level_with_its_own_statistics(tmp_path):
    """`local_eval_model: own-level`: each client's own level, BatchNorm statistics from its
    own training data, its label mask; reported per level under `local width=r`."""
    sim = _heterofl_digits(tmp_path, local_eval_model="own-level")
    sim.run()
    row = sim.metrics.read()[-1]
    strategy = sim.strategy
    by_level: dict[float, list[float]] = {}
    for cid, data in sim.clients.items():
        ratio = strategy.assignment.level_of[cid]
        judged = strategy.evaluation.local_eval.pick(strategy._layout, sim.infos[cid])
        assert judged.group == f"local width={ratio:g}"
        em = eval_model_at(
            sim.programs.family,
            judged.spec,
            strategy._index_map_for(judged.trained),
            sim.state,
            name="own",
            stats_pass=True,
        )
        model = sim.programs.family.build(em.spec)
        model.load_state_dict(em.tensors)
        recompute_bn_statistics(model, data.x_train)
        by_level.setdefault(ratio, []).append(_masked_accuracy(model, data))
    for ratio, accs in by_level.items():
        assert row["groups"][f"local width={ratio:g}"]["acc"] == pytest.approx(
            sum(accs) / len(accs), abs=1e-12
        )
    everyone = [a for accs in by_level.values() for a in accs]
    assert row["local_acc"] == pytest.approx(sum(everyone) / len(everyone), abs=1e-12)


def test_heterofl_with_private_layers_uses_own_level_and_says_so() -> None:
    """The full-rate global model cannot hold private layers: `own-level` runs, and
    `describe()` (summary.json's "strategy", the start banner) says why."""
    fam = _family("stage-cnn")
    strategy, _ = ALGORITHMS.get("heterofl").build(
        fam, {"private_norm": True}, clients_per_round=1, train=TRAIN
    )
    assert isinstance(strategy.evaluation.local_eval, LocalModel)
    assert strategy.describe()["local_eval_model"] == (
        "own-level (private layers cannot load into the full-rate global model)"
    )
    default, _ = ALGORITHMS.get("heterofl").build(fam, {}, clients_per_round=1, train=TRAIN)
    info = ClientInfo(0, 10, FAMILIES["stage-cnn"], (0, 1))
    state = default.setup([info], torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=r"evaluated full-rate model 'width=1'.*gave \[\]"):
        default.eval_task(info, state, {})


# -- width levels, private layers and clipping at the edge ----------------------------------------
def _tiny(name: str = "stage-cnn", classes: int = 4, **base) -> ScalableFamily:
    """One stage on 8x8 single-channel inputs: 32 channels at width 1."""
    spec = {"family": name, "input_shape": (1, 8, 8), "num_classes": classes, "stages": 1}
    return ScalableFamily({**spec, **base})


def _infos_of(sizes, labels=(0, 1, 2, 3)) -> list[ClientInfo]:
    return [ClientInfo(cid, n, (1, 8, 8), tuple(labels)) for cid, n in enumerate(sizes)]


@pytest.mark.parametrize("algorithm", ["heterofl", "fjord"])
def test_levels_keep_their_proportions_whatever_their_order(algorithm: str) -> None:
    infos = _infos_of([10] * 10)
    strategy, _, _, _ = _plan(algorithm, _tiny(), infos, levels=(1.0, 0.5), proportions=(0.7, 0.3))
    widths = [strategy.assignment.spec_of(c)["widths"][0] for c in infos]
    assert widths == [0.5] * 3 + [1.0] * 7  # narrowest first, in id order


def test_heterofl_dynamic_width_with_private_layers_is_refused_at_the_config_edge() -> None:
    raw = {"algorithm": "heterofl", "model": {"name": "stage-cnn"}}
    for private in ("private_norm", "private_head"):
        options = {"heterofl": {"assignment": "dynamic", private: True}}
        with pytest.raises(ConfigError, match=r"options\.heterofl: assignment 'dynamic' with "):
            validate({**raw, "options": options})
    message = "cannot follow a width that changes every round"
    with pytest.raises(ValidationError, match=message):
        ALGORITHMS.get("heterofl").build(
            _tiny(),
            {"assignment": "dynamic", "private_head": True},
            clients_per_round=1,
            train=TRAIN,
        )
    fixed = {"heterofl": {"assignment": "fixed", "private_head": True}}
    assert validate({**raw, "options": fixed}).options == fixed


def test_a_private_tensor_that_misfits_the_model_names_the_client_and_the_tensor() -> None:
    """A client kept its private head at width 1 and is handed a width-0.5 model (what
    HeteroFL's dynamic assignment with private layers did): training and local evaluation
    both stop with the client, the tensor and both shapes, not a load_state_dict error."""
    fam = _tiny()
    program = Programs(fam, seed=0).program_for(3)
    wide = fam.normalise({**fam.base, "width": 1.0})
    narrow = fam.normalise({**fam.base, "width": 0.5})
    kept = {k: v for k, v in _global(fam).items() if k.startswith("head.")}  # (4, 32), (4,)
    kept["momentum/stages.0.conv.weight"] = torch.zeros(32, 1, 3, 3)  # resets, not an error
    imap = [e for e in fam.index_map(narrow) if not e.local.startswith("head.")]
    payload = extract(_global(fam), imap)
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    data = ClientData(3, x, torch.arange(4), x, torch.arange(4), 4)
    task = ClientTask(3, narrow, payload, imap, LocalTraining(lr=0.1, steps=1, batch_size=4))
    expected = r"client 3: its private tensor 'head.weight' has shape \(4, 32\).* needs \(4, 16\)"
    with pytest.raises(ValueError, match=expected):
        program.fit(task, data, kept, torch_generator(0, 1, 3, "train"), info=data.info())
    with pytest.raises(ValueError, match=expected):
        program.evaluate(EvalTask(3, narrow, payload, imap), data, kept, ModelCache(fam))
    shared = [e for e in fam.index_map(wide) if not e.local.startswith("head.")]
    same_width = ClientTask(3, wide, extract(_global(fam), shared), shared, task.config)
    out = program.fit(same_width, data, kept, torch_generator(0, 1, 3, "train"), info=data.info())
    assert out.private["head.weight"].shape == (4, 32)


@pytest.mark.parametrize(("clip", "runs"), [(None, 1.0), (0.25, 0.25)])
def test_heterofl_clips_at_1_unless_train_sets_it_and_says_which(clip, runs, tmp_path) -> None:
    cfg = validate(
        {
            "algorithm": "heterofl",
            "data": {"dataset": "digits", "num_clients": 2, "test_per_client": 0},
            "model": {"name": "stage-cnn", "stages": 1},
            "train": {"rounds": 1, "clients_per_round": 2, "clip_grad_norm": clip},
            "options": {"heterofl": {"levels": [1.0, 0.5]}},
        }
    )
    sim = build_simulation(cfg, tmp_path, show_progress=False)
    sim.setup()
    tasks = sim.strategy.plan(
        1, sim.state, sim.known_clients(), torch_generator(0, 1, -1, "sample")
    )
    assert [t.config.clip_grad_norm for t in tasks] == [runs, runs]
    assert f"  clip_grad_norm: {runs}" in start_banner(cfg, sim, tmp_path).splitlines()
    assert sim.info["strategy"]["clip_grad_norm"] == runs  # summary.json's "strategy"
    with pytest.raises(ConfigError, match=r"options\.heterofl: clip_grad_norm is not a heterofl"):
        validate({**cfg.model_dump(), "options": {"heterofl": {"clip_grad_norm": 0.5}}})


# -- HeteroFL's and FjORD's training and aggregation by hand -------------------------------------
def test_heterofl_step_is_masked_cross_entropy_clipped_at_1_by_hand() -> None:
    """One full-batch step of a width-0.5 client holding classes 0 and 2: logits of 1 and 3
    set to 0, cross-entropy, the gradient scaled to norm 1 (PyTorch's clip_grad_norm_:
    1 / (norm + 1e-6)), then SGD. Written out on a copy of the client's model."""
    fam = _tiny()
    infos = _infos_of([8, 8], labels=(0, 2))
    _, recipe, tasks, _ = _plan("heterofl", fam, infos, levels=(1.0, 0.5))
    task = tasks[0]
    assert task.spec["widths"][0] == 0.5 and task.config.clip_grad_norm == 1.0
    task.config = replace(task.config, steps=1, batch_size=8)
    task.payload["head.weight"] *= 8  # a gradient norm well above 1
    x = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    y = torch.tensor([0, 2, 2, 0, 2, 0, 0, 2])
    data = ClientData(0, x, y, x[:0], y[:0], 4)
    out = (
        Programs(fam, recipe, seed=0)
        .program_for(0)
        .fit(task, data, {}, torch_generator(0, 1, 0, "train"), info=data.info())
    )

    model = fam.build(task.spec)
    model.load_state_dict(task.payload)
    model.train()
    logits = model(x)
    masked = torch.stack([logits[:, 0], 0 * logits[:, 1], logits[:, 2], 0 * logits[:, 3]], 1)
    loss = -(masked.log_softmax(1)[torch.arange(8), y]).mean()
    params = dict(model.named_parameters())
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    assert norm > 1.5  # so the clipping binds
    for k, g in grads.items():
        expected = params[k].detach() - task.config.lr * g / (norm + 1e-6)
        torch.testing.assert_close(out.result.tensors[k], expected, rtol=0, atol=2e-6)


def test_heterofl_dynamic_assignment_redraws_each_clients_width_every_round() -> None:
    """Each sampled client draws its width in the configured proportions every round, in
    client id order from the round's sampling generator (after the sample itself)."""
    infos = _infos_of([10] * 4)
    strategy, _, _, state = _plan(
        "heterofl",
        _tiny(),
        infos,
        levels=(1.0, 0.5),
        proportions=(0.75, 0.25),
        assignment="dynamic",
        local_eval_model="own-level",
    )
    assert {s["widths"][0] for s in strategy.assignment.possible_specs()} == {0.5, 1.0}
    drawn: dict[int, list[float]] = {c.cid: [] for c in infos}
    for rnd in range(1, 26):
        g = torch_generator(0, rnd, -1, "sample")
        tasks = strategy.plan(rnd, state, infos, torch_generator(0, rnd, -1, "sample"))
        for t in tasks:
            by_hand = torch.multinomial(
                torch.tensor([0.25, 0.75], dtype=torch.float64), 1, generator=g
            )
            assert t.spec["widths"][0] == (0.5, 1.0)[int(by_hand)]
            assert t.payload["stages.0.conv.weight"].shape[0] == channels(t.spec["widths"][0], 32)
            drawn[t.cid].append(t.spec["widths"][0])
    assert all(set(widths) == {0.5, 1.0} for widths in drawn.values())  # widths change
    share = sum(w == 1.0 for ws in drawn.values() for w in ws) / 100
    assert 0.65 <= share <= 0.85  # 0.75 +- 2.3 standard deviations
    assert strategy.eval_task(infos[0], state, {}).group == "local width=1"  # the widest


def test_fjord_averages_bands_by_samples_and_each_widths_statistics_over_its_clients() -> None:
    """Tiers 0.5 (client 0, 10 samples) and 1 (clients 1 and 2, 30 and 60 samples) send
    1, 2 and 4 everywhere. Channels 0-15 are held by all: (10 + 60 + 240) / 100 = 3.1;
    channels 16-31 by the width-1 clients: (60 + 240) / 90. Width 0.5's running statistics
    come from all three, width 1's from the width-1 clients only."""
    infos = _infos_of([10, 30, 60])
    strategy, _, tasks, state = _plan(
        "fjord", _tiny(), infos, levels=(1.0, 0.5), proportions=(2, 1)
    )
    assert [t.spec["widths"][0] for t in tasks] == [0.5, 1.0, 1.0]
    results = [
        ClientResult(t.cid, {k: torch.full_like(v, value) for k, v in t.payload.items()}, n, 1, 0.0)
        for t, value, n in zip(tasks, (1.0, 2.0, 4.0), (10, 30, 60), strict=True)
    ]
    after = strategy.aggregate(1, state, trained(tasks, results)).state
    all_three, wide_only = 3.1, 300 / 90

    def equals(t: torch.Tensor, value: float) -> bool:
        return torch.allclose(t, torch.full_like(t, value), rtol=0, atol=1e-6)

    for name in ("stages.0.conv.weight", "stages.0.norm.weight", "stages.0.norm.bias"):
        assert equals(after[name][:16], all_three) and equals(after[name][16:], wide_only), name
    assert equals(after["head.weight"][:, :16], all_three)
    assert equals(after["head.weight"][:, 16:], wide_only)
    assert equals(after["head.bias"], all_three)
    for stat in ("running_mean", "running_var"):
        assert equals(after[f"stages.0.norm.{stat}_w0p5"], all_three)
        assert equals(after[f"stages.0.norm.{stat}_w1"], wide_only)  # channels 0-15 too


class _Logits:
    """A stand-in model: fixed logits per width (leaf tensors), the widths it ran at."""

    def __init__(self, by_width: dict[float, torch.Tensor]) -> None:
        self.by_width, self.ran = by_width, []

    def __call__(self, x: torch.Tensor, width: float) -> torch.Tensor:
        self.ran.append(width)
        return self.by_width[width]


def test_fjord_distillation_loss_and_its_gradients_by_hand() -> None:
    """At p < p_max: CE(teacher) + sum_j softmax(teacher)_j * -log softmax(student)_j per
    sample, with the teacher's soft labels held fixed, so d/d teacher is the CE gradient
    softmax(t) - onehot(y) and d/d student is softmax(s) - softmax(t) (over the batch of 2).
    At p = p_max: plain cross-entropy."""
    t_rows, s_rows, y = (
        [[2.0, 0.0, -1.0], [0.5, 1.0, 0.0]],
        [[1.0, 1.0, 0.0], [0.0, 2.0, 1.0]],
        [0, 2],
    )

    def softmax(row: list[float]) -> list[float]:
        z = sum(math.exp(v) for v in row)
        return [math.exp(v) / z for v in row]

    teacher = torch.tensor(t_rows, dtype=torch.float64, requires_grad=True)
    student = torch.tensor(s_rows, dtype=torch.float64, requires_grad=True)
    model = _Logits({1.0: teacher, 0.5: student})
    forward = OrderedDropout((0.5, 1.0), distill=True)
    spec = Spec(model="stand-in", widths=(1.0,))
    ctx = TrainContext(
        ClientTask(0, spec, {}, []), {}, torch.Generator().manual_seed(0), LocalTraining(lr=0.1)
    )
    x, labels = torch.zeros(2, 1), torch.tensor(y)
    while model.ran[-1:] != [0.5]:  # draw widths until one is below p_max
        model.ran.clear()
        _, per_sample = forward(model, x, labels, ctx)
        if model.ran == [1.0]:  # p = p_max: no student pass, plain cross-entropy
            ce = [
                math.log(sum(math.exp(v) for v in r)) - r[c] for r, c in zip(t_rows, y, strict=True)
            ]
            assert per_sample.tolist() == pytest.approx(ce, abs=1e-12)
    assert model.ran == [1.0, 0.5]
    expected = []
    for t, s, c in zip(t_rows, s_rows, y, strict=True):
        ce = -math.log(softmax(t)[c])
        kd = -sum(pt * math.log(ps) for pt, ps in zip(softmax(t), softmax(s), strict=True))
        expected.append(ce + kd)
    assert per_sample.tolist() == pytest.approx(expected, abs=1e-12)
    per_sample.mean().backward()
    for i, (t, s, c) in enumerate(zip(t_rows, s_rows, y, strict=True)):
        d_teacher = [(p - (j == c)) / 2 for j, p in enumerate(softmax(t))]
        d_student = [(ps - pt) / 2 for ps, pt in zip(softmax(s), softmax(t), strict=True)]
        assert teacher.grad[i].tolist() == pytest.approx(d_teacher, abs=1e-12)
        assert student.grad[i].tolist() == pytest.approx(d_student, abs=1e-12)
