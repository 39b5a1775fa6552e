"""The SSD-style detector on ScalableFL's stage backbone: default boxes, SSD's loss against a
hand computation (Liu et al., ECCV 2016, §2.2), MACs and bytes by hand, and local training
through HetFL's loop that learns the synthetic shapes."""

from __future__ import annotations

import math

import pytest
import torch

from hetfl.algorithms import ALGORITHMS
from hetfl.core.client.detection_scoring import evaluate_detector
from hetfl.core.client.loop import train_local
from hetfl.core.client.multibox import MultiBoxLoss, encode, match
from hetfl.core.client.program import Programs
from hetfl.core.client.recipe import LocalRecipe, TrainContext
from hetfl.core.rng import torch_generator
from hetfl.core.server.maps import private_layers
from hetfl.core.spec import Spec
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, ClientTask, PassRecord
from hetfl.data.detection_views import DetectionGroup, detection_clients
from hetfl.data.synthetic_detection import synthetic_detection
from hetfl.models import ScalableFamily, SpecError
from hetfl.models.scaling import ScalingRule
from hetfl.models.ssd import default_boxes, feature_sides
from hetfl.systems.costs import MacCounter
from strategies import trained

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _spec(side: int, stages: int, classes: int = 2, width: float = 0.25, heads: int = 1) -> Spec:
    return _family().checked(
        {
            "family": "ssd-stage-cnn",
            "input_shape": (3, side, side),
            "num_classes": classes,
            "stages": stages,
            "width": width,
            "heads": heads,
        }
    )


def _family() -> ScalableFamily:
    return ScalableFamily({"family": "ssd-stage-cnn", "input_shape": (3, 64, 64), "num_classes": 6})


def test_default_boxes_by_hand_and_the_same_for_clients_of_one_last_side():
    spec = _spec(16, 2)  # 16 -> 8 -> 4: one head on the 4x4 map
    boxes = default_boxes(spec)
    assert feature_sides(spec) == [(4, 4)] and boxes.shape == (4 * 4 * 4, 4)
    # place (0, 0): centre (1/8, 1/8); s = 0.2, ratio 2: w = 0.2 sqrt 2, h = 0.2 / sqrt 2;
    # the extra box sqrt(0.2 * 1); boxes clipped to the image
    r = math.sqrt(2)
    want = [
        [0.125 - 0.1, 0.125 - 0.1, 0.125 + 0.1, 0.125 + 0.1],
        [0, 0.125 - 0.1 / r, 0.125 + 0.1 * r, 0.125 + 0.1 / r],
        [0.125 - 0.1 / r, 0, 0.125 + 0.1 / r, 0.125 + 0.1 * r],
        [0, 0, 0.125 + math.sqrt(0.2) / 2, 0.125 + math.sqrt(0.2) / 2],
    ]
    torch.testing.assert_close(boxes[:4], torch.tensor(want), atol=1e-6, rtol=0)
    # ScalableFL's depth rule puts 16 px and 32 px clients on the same head maps
    small, large = _spec(16, 2, heads=2), _spec(32, 3, heads=2)
    assert feature_sides(small) == feature_sides(large) == [(8, 8), (4, 4)]
    torch.testing.assert_close(default_boxes(small), default_boxes(large))


def test_outputs_heads_and_the_index_map():
    family = _family()
    spec = _spec(32, 3, classes=3, heads=2)
    model = family.build(spec)
    out = model(torch.zeros(2, 3, 32, 32))
    assert out.shape == (2, default_boxes(spec).shape[0], 4 + 3 + 1)
    head = {f"head.{k}" for k in model.head.state_dict()}
    # the heads see the last two stages' channels: ceil(0.25 * 64), ceil(0.25 * 128)
    assert model.head.classes[0].weight.shape == (4 * 4, 16, 3, 3)
    assert model.head.boxes[1].weight.shape == (4 * 4, 32, 3, 3)
    imap = {e.local: e for e in family.index_map(spec)}
    assert head <= set(imap) and set(imap) == set(model.state_dict())


def test_bad_settings_are_refused():
    with pytest.raises(SpecError, match=r"heads must be an integer in 1\.\.stages"):
        _spec(32, 2, heads=3)
    with pytest.raises(SpecError, match="too small for 3 stage"):
        _spec(4, 3)
    with pytest.raises(ValueError, match="matching threshold"):
        MultiBoxLoss(default_boxes, threshold=1.0)


# priors P0..P3 the image's quarters; one object, class 0, at [0, 0, .5, .4]: IoU 0.8 with P0
PRIORS = torch.tensor([[0, 0, 0.5, 0.5], [0.5, 0.5, 1, 1], [0, 0.5, 0.5, 1], [0.5, 0, 1, 0.5]])
TARGET = torch.tensor([[[0, 0, 0, 0.5, 0.4, 0], [-1, 0, 0, 0, 0, 0]]])


def test_ssd_loss_by_hand():
    # offsets 0; logits (background, class 0): P0 (0, 0), P1 (0, 2), P2 (0, 1), P3 (0, 0)
    outputs = torch.zeros(1, 4, 6)
    outputs[0, 1, 5], outputs[0, 2, 5] = 2.0, 1.0
    loss = MultiBoxLoss(lambda s: PRIORS, negatives_per_positive=1, variances=(1.0, 1.0))
    got = loss.per_sample(outputs, TARGET, PRIORS)
    # one positive (P0): its class loss log 2; one hard negative, P1's log(1 + e^2)
    conf = math.log(2) + math.log(1 + math.e**2)
    # P0's offsets to the object: (0, (0.2 - 0.25) / 0.5, log 1, log 0.8); smooth L1 of each
    t = [0.0, -0.1, 0.0, math.log(0.8)]
    loc = sum(0.5 * v * v if abs(v) < 1 else abs(v) - 0.5 for v in t)
    assert float(got[0]) == pytest.approx(conf + loc, rel=1e-6)
    # 3 negatives per positive: P2's log(1 + e) and P3's log 2 join
    three = MultiBoxLoss(lambda s: PRIORS, variances=(1.0, 1.0)).per_sample(outputs, TARGET, PRIORS)
    assert float(three[0]) == pytest.approx(conf + loc + math.log(1 + math.e) + math.log(2))
    torch.testing.assert_close(
        encode(TARGET[:, :1, 1:5], PRIORS[:1], (1.0, 1.0))[0, 0], torch.tensor(t)
    )


def test_an_object_without_a_good_prior_keeps_its_best_one():
    tiny = torch.tensor([[[1, 0.0, 0.0, 0.1, 0.1, 0]]])  # IoU 0.04 with P0, 0 elsewhere
    classes, boxes = match(PRIORS, tiny, 0.5)
    assert classes.tolist() == [[2, 0, 0, 0]]
    torch.testing.assert_close(boxes[0, 0], tiny[0, 0, 1:5])
    no_objects = torch.tensor([[[-1, 0, 0, 0, 0, 0.0]]])
    loss = MultiBoxLoss(lambda s: PRIORS).per_sample(torch.randn(1, 4, 7), no_objects, PRIORS)
    assert float(loss[0]) == 0.0  # N = 0: L = 0 (SSD eq. 1)


def test_macs_and_bytes_by_hand():
    # 8 px, 1 stage at width 1/8: conv 3 -> 4 channels (ceil(32 / 8)), 4x4 output; one head
    # on it: class conv 4 -> 4 (2 + 1) = 12, box conv 4 -> 16, both 3x3 on 4x4
    spec = _spec(8, 1, classes=2, width=1 / 8)
    family = _family()
    forward = MacCounter(family).pass_macs(PassRecord(spec, "forward", 1, 1), (3, 8, 8))
    stage = 16 * 4 * 3 * 9
    heads = 16 * (12 + 16) * 4 * 9
    assert forward == stage + heads
    # bytes: conv weight 4x3x3x3 (no bias: BN follows), BN weight, bias, running mean, var
    # and the batch counter, class conv 12x4x3x3 + 12, box conv 16x4x3x3 + 16; float32
    model = family.build(spec)
    sizes = {k: v.numel() for k, v in model.state_dict().items()}
    assert sum(sizes.values()) == 108 + 4 * 4 + 1 + 12 * 36 + 12 + 16 * 36 + 16
    nbytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    assert nbytes == 4 * (108 + 16 + 432 + 12 + 576 + 16) + 8  # the counter is int64


def test_local_training_through_the_loop_learns_the_shapes():
    data = synthetic_detection(
        n_train=256, n_test=64, num_classes=2, side=16, max_objects=1, min_size=0.3, max_size=0.6
    )
    spec = _spec(16, 2, classes=2, width=0.5, heads=2)
    family = _family()
    torch.manual_seed(0)
    model = family.build(spec)
    loss = MultiBoxLoss(default_boxes)
    x_train = torch.from_numpy(data.x_train.copy())
    x_test = torch.from_numpy(data.x_test.copy())
    t_train = torch.from_numpy(data.targets_train.copy())
    t_test = torch.from_numpy(data.targets_test.copy())
    client = ClientData(0, x_train, t_train, x_test, t_test, 2, pixels=data.pixels)
    priors = default_boxes(spec)
    before = evaluate_detector(model, x_test, t_test, loss, priors, 2, pixels=data.pixels)
    settings = LocalTraining(lr=0.02, steps=100, batch_size=16, momentum=0.9)
    task = ClientTask(0, spec, {}, family.index_map(spec))
    params = {k: v for k, v in model.named_parameters()}
    buffers = {k: v for k, v in model.named_buffers()}
    ctx = TrainContext(
        task=task,
        received={},
        generator=torch_generator(0, 1, 0, "train"),
        settings=settings,
        params=params,
        buffers=buffers,
    )
    stats = train_local(model, client, LocalRecipe(forward=loss), ctx)
    after = evaluate_detector(model, x_test, t_test, loss, priors, 2, pixels=data.pixels)
    # test loss and mAP@0.5 of the untrained and trained detector (0.01 and 0.46 here)
    assert stats.num_steps == 100 and after[1] < before[1]
    assert before[0] is not None and before[0] < 0.05
    assert after[0] is not None and after[0] > 0.3


def test_scalablefl_sizes_the_detector_and_keeps_its_heads_and_norms_private():
    """ScalableFL's rule (§III-A, H0 = 4 for detection): a 16 px, 2-class client trains 2
    stages at kappa = log10 2 / log10 6; a 64 px, 6-class client 4 stages at 1. Only the
    backbone's convolutions are shared, as nested slices of the global model's."""
    family = _family()
    base = family.global_spec([]).replace(heads=2)
    rule = ScalingRule(family, base, 4, 6)
    small, large = rule.model((3, 16, 16), 2), rule.model((3, 64, 64), 6)
    kappa = math.log10(2) / math.log10(6)
    assert (small.depth, small.spec["stages"], large.spec["stages"]) == (2, 2, 4)
    assert small.spec["widths"][0] == pytest.approx(kappa) and large.spec["widths"][0] == 1
    (private,) = private_layers(family, norm=True, head=True)
    shared = {e.local: e for e in private.shared(family.index_map(small.spec), small.spec)}
    assert set(shared) == {"stages.0.conv.weight", "stages.1.conv.weight"}
    # ceil(kappa * 32) = 13 and ceil(kappa * 64) = 25 channels, slices of the global 32, 64
    model = family.build(small.spec)
    assert model.stages[0].conv.weight.shape == (13, 3, 3, 3)
    assert model.stages[1].conv.weight.shape == (25, 13, 3, 3)
    glob = family.global_spec([small.spec, large.spec])
    assert glob["stages"] == 4 and glob["widths"][:4] == (1.0, 1.0, 1.0, 1.0)
    # the heads see the same 8x8 and 4x4 maps in both clients: equal default boxes
    torch.testing.assert_close(default_boxes(small.spec), default_boxes(large.spec))


def test_a_scalablefl_round_trains_detection_clients_of_two_groups():
    """ScalableFL built on the detector trains with SSD's loss (§V-B); one round over a
    16 px, 2-class and a 32 px, 4-class client: each sends only its backbone slices, keeps
    its heads and BN, and the global backbone moves where a client covered it."""
    data = synthetic_detection(n_train=40, n_test=8, num_classes=4, side=32, seed=5)
    groups = [DetectionGroup(16, 2, 1), DetectionGroup(32, 4, 1)]
    clients = detection_clients(data, groups, seed=0)
    family = ScalableFamily(
        {
            "family": "ssd-stage-cnn",
            "input_shape": (3, 32, 32),
            "num_classes": 4,
            "stages": 3,
            "heads": 2,
        }
    )
    train = LocalTraining(lr=0.02, steps=3, batch_size=8, momentum=0.9)
    options = {"base_size": 4, "base_classes": 4, "participation": 1.0}
    strategy, recipe = ALGORITHMS.get("scalablefl").build(
        family, options, clients_per_round=2, train=train
    )
    assert isinstance(recipe.forward, MultiBoxLoss)
    infos = [c.info() for c in clients]
    assert [(i.input_shape[1], i.labels) for i in infos] == [(16, (0, 1)), (32, (0, 1, 2, 3))]
    state = strategy.setup(infos, torch_generator(0, 0, -1, "init"), rounds=1)
    assert set(state) == {f"stages.{i}.conv.weight" for i in range(3)}
    tasks = strategy.plan(1, state, infos, torch_generator(0, 1, -1, "sample"))
    assert [t.spec["stages"] for t in tasks] == [2, 3]
    programs = Programs(family, recipe, seed=0)
    results = []
    for task, client, info in zip(tasks, clients, infos, strict=True):
        gen = torch_generator(0, 1, info.cid, "train")
        out = programs.program_for(info.cid).fit(task, client, {}, gen, info=info)
        assert set(out.result.tensors) == set(task.payload) and math.isfinite(out.result.loss)
        assert any(k.startswith("head.") for k in out.private)
        results.append(out.result)
    new = strategy.aggregate(1, state, trained(tasks, results)).state
    assert not torch.equal(new["stages.2.conv.weight"], state["stages.2.conv.weight"])
