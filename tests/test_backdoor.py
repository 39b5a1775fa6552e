"""The trigger backdoor (`hetfl.attacks.backdoor`, `hetfl.attacks.trigger`) and `attack_success`:
the stamp, the poisoned share of each batch and its seeded choice, the boosted upload and the
label mask by hand; attack_success by hand on a hand-set linear model; bad settings refused
at the config edge or at set-up; a short backdoored run."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import pytest
import torch

import hetfl.assembly
from hetfl.attacks.backdoor import Backdoor, poisoned_count
from hetfl.attacks.poisoning import ATTACK_PURPOSE
from hetfl.attacks.trigger import AttackSuccess, Trigger
from hetfl.config import ConfigError, validate
from hetfl.core.client.program import Programs
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.client.scoring import evaluate_model
from hetfl.core.client.terms import MaskedCrossEntropy
from hetfl.core.model_cache import ModelCache
from hetfl.core.pixels import PixelNorm
from hetfl.core.rng import sibling_generator, torch_generator
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, ClientOutput, ClientResult, ClientTask, EvalModel
from hetfl.data.dataset import Dataset
from hetfl.engine.global_eval import plan_global
from hetfl.models.base import PlainFamily
from hetfl.runner import build_simulation

#: Pixels standardised as x / 255: a stamped pixel is 1.0 to the model.
UNIT = PixelNorm((0.0,), (1.0,))


# -- the stamp ------------------------------------------------------------------------------------
def test_the_stamp_sets_the_bottom_right_square_to_255_in_every_channel() -> None:
    x = torch.arange(2 * 2 * 4 * 4, dtype=torch.uint8).view(2, 2, 4, 4)  # (N, C, H, W)
    stamped = Trigger(patch=2, target=1).stamp(x)
    expected = x.clone()
    for n in range(2):
        for c in range(2):
            for h in (2, 3):
                for w in (2, 3):
                    expected[n, c, h, w] = 255
    assert stamped.dtype == torch.uint8 and torch.equal(stamped, expected)
    assert int(x.max()) == 63  # the input is not changed
    resized = x.to(torch.float32)  # a view's resize keeps 0..255 floats
    assert torch.equal(Trigger(2, 1).stamp(resized), expected.to(torch.float32))


def test_triggered_test_images_leave_out_the_target_class() -> None:
    x = torch.zeros(4, 1, 3, 3, dtype=torch.uint8)
    y = torch.tensor([1, 0, 2, 1])
    x_hit, y_hit = Trigger(patch=1, target=1).triggered(x, y)
    assert y_hit.tolist() == [1, 1] and x_hit.shape == (2, 1, 3, 3)
    assert x_hit[:, 0, 2, 2].tolist() == [255, 255] and int(x_hit.sum()) == 2 * 255


# -- a malicious client's batches -----------------------------------------------------------------
@dataclass
class BatchRecorder:
    """Honest "training" that draws two batches (samples 0-4, then 5-8) as the loop draws
    them and moves every float weight by +1."""

    cid: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    batches: list = field(default_factory=list)
    infos: list = field(default_factory=list)

    def fit(self, task, data, private, generator, *, info, channel=None):
        self.infos.append(info)
        augment = sibling_generator(generator, "augment")
        for idx in (torch.arange(5), torch.arange(5, 9)):
            self.batches.append(data.train_batch(idx, augment))
        tensors = {k: v + 1 if v.is_floating_point() else v + 7 for k, v in task.payload.items()}
        result = ClientResult(task.cid, tensors, data.n_train, 2, 0.5)
        return ClientOutput(result=result, private={})

    def evaluate(self, *args):
        raise NotImplementedError


X9 = torch.full((9, 1, 4, 4), 10, dtype=torch.uint8)
Y9 = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1, 0])


def _task() -> ClientTask:
    payload = {"w": torch.tensor([1.0, -2.0]), "steps": torch.tensor(0)}
    return ClientTask(0, PlainFamily("linear", (2,), 3).global_spec([]), payload, [])


def _fit(program, generator):
    data = ClientData(0, X9, Y9, X9[:0], Y9[:0], 3, pixels=UNIT)
    return program.fit(_task(), data, {}, generator, info=data.info())


def test_each_batch_poisons_its_rounded_share_chosen_by_the_attack_sibling() -> None:
    """0.5 of a batch of 5 is 3 (halves up), of 4 is 2; the samples are the first ones of a
    permutation per batch from the "attack" sibling of the client's training generator;
    each gets the patch (1.0 once standardised) and label 2, the others stay as they were."""
    assert [poisoned_count(b, f) for b, f in [(5, 0.5), (4, 0.5), (5, 0.3), (3, 0.1)]] == [
        3,
        2,
        2,
        0,
    ]
    honest = BatchRecorder()
    generator = torch_generator(0, 1, 0, "train")
    _fit(Backdoor(Trigger(2, 2), 0.5, 1.0)(honest), generator)
    attack = sibling_generator(generator, ATTACK_PURPOSE)
    for (x, y), rows, k in zip(honest.batches, (range(5), range(5, 9)), (3, 2), strict=True):
        chosen = set(torch.randperm(len(rows), generator=attack)[:k].tolist())
        for i, sample in enumerate(rows):
            corner = x[i, 0, 2:, 2:]
            if i in chosen:
                assert int(y[i]) == 2 and bool((corner == 1.0).all()), (sample, i)
            else:
                assert int(y[i]) == int(Y9[sample]) and bool((corner == 10 / 255).all())
            assert bool((x[i, 0, :2] == 10 / 255).all())  # only the patch changes
    assert int(X9.max()) == 10 and Y9.max() == 1  # the client's stored data is untouched
    again = BatchRecorder()
    _fit(Backdoor(Trigger(2, 2), 0.5, 1.0)(again), torch_generator(0, 1, 0, "train"))
    assert all(torch.equal(a[1], b[1]) for a, b in zip(honest.batches, again.batches, strict=True))


def test_the_upload_is_received_plus_lambda_times_the_backdoored_update() -> None:
    """Trained w = received + 1: λ 2 uploads received + 2·1; λ 1 the trained tensors as they
    are; integer tensors as trained."""
    gen = partial(torch_generator, 0, 1, 0, "train")
    boosted = _fit(Backdoor(Trigger(1, 2), 0.5, 2.0)(BatchRecorder()), gen()).result.tensors
    assert torch.equal(boosted["w"], torch.tensor([3.0, 0.0])) and int(boosted["steps"]) == 7
    plain = _fit(Backdoor(Trigger(1, 2), 0.5, 1.0)(BatchRecorder()), gen()).result.tensors
    assert torch.equal(plain["w"], torch.tensor([2.0, -1.0])) and int(plain["steps"]) == 7


def test_the_label_mask_follows_the_target() -> None:
    """One full-batch SGD step (lr 1) from zero weights, masked cross-entropy: every logit is
    0, so each kept class's bias becomes its share of the batch's labels - 1/3 and a masked
    class's stays 0. The client holds class 0 only; half its batch is relabelled 1 (the
    target): bias [1/2 - 1/3, 1/2 - 1/3, 0]. Had the mask not followed, class 1 would be
    masked (bias 0)."""
    family = PlainFamily("linear", (1, 2, 2), 3)
    spec = family.global_spec([])
    imap = family.index_map(spec)
    payload = {k: torch.zeros_like(v) for k, v in family.build(spec).state_dict().items()}
    task = ClientTask(0, spec, payload, imap, LocalTraining(lr=1.0, steps=1, batch_size=4))
    x = torch.zeros(4, 1, 2, 2, dtype=torch.uint8)
    y = torch.zeros(4, dtype=torch.long)
    data = ClientData(0, x, y, x[:0], y[:0], 3, pixels=UNIT)
    programs = Programs(family, LocalRecipe(forward=MaskedCrossEntropy()), seed=0)
    program = Backdoor(Trigger(1, 1), 0.5, 1.0)(programs.program_for(0))
    out = program.fit(task, data, {}, torch_generator(0, 1, 0, "train"), info=data.info())
    bias = out.result.tensors["head.bias"]
    assert torch.allclose(bias, torch.tensor([1 / 6, 1 / 6, 0.0]), atol=1e-7)
    recorder = BatchRecorder()
    _fit(Backdoor(Trigger(1, 2), 0.5, 1.0)(recorder), torch_generator(0, 1, 0, "train"))
    assert recorder.infos[0].labels == (0, 1, 2)


# -- attack_success -------------------------------------------------------------------------------
@dataclass
class TwoModels:
    """A strategy's global evaluation naming two models (FedFA's `ArchitectureModels` is a
    list too): the first is the one global_acc and attack_success score."""

    models: list[EvalModel]

    def eval_models(self, state):
        return self.models


def _linear(weight1: list[float], bias: list[float]) -> dict[str, torch.Tensor]:
    weight = torch.zeros(2, 4)
    weight[1] = torch.tensor(weight1)
    return {"head.weight": weight, "head.bias": torch.tensor(bias)}


def test_attack_success_by_hand_on_a_hand_set_linear_model() -> None:
    """2x2 one-channel images, pixels / 255. The main model: logit0 = 0.5, logit1 = x[1,1] -
    x[0,0], so a triggered image (x[1,1] = 1) is called 1 (the target) iff its top-left
    pixel is below 127.5. Non-target images' top-left pixels 0, 200, 100, 130, 10: 3 of 5
    hit, 0.6 (the two target-class images, which would hit, are left out: 5/7 otherwise).
    The second model calls everything 1 (1.0): not the one scored."""
    family = PlainFamily("linear", (1, 2, 2), 2)
    spec = family.global_spec([])
    x = torch.zeros(7, 1, 2, 2, dtype=torch.uint8)
    x[:, 0, 0, 0] = torch.tensor([0, 0, 200, 100, 0, 130, 10], dtype=torch.uint8)
    y = torch.tensor([0, 1, 0, 0, 1, 0, 0])
    main = EvalModel("main", spec, _linear([-1.0, 0.0, 0.0, 1.0], [0.5, 0.0]))
    other = EvalModel("other", spec, _linear([0.0] * 4, [0.0, 1.0]), group="other")
    models = ModelCache(family)

    def evaluate(probes=None):
        plan = plan_global(TwoModels([main, other]).eval_models({}), (x, y), (), probes or {})
        answers = []
        for scoring in plan.scorings:
            model = models.model_for(scoring.model.spec)
            model.load_state_dict(scoring.model.tensors)
            answers.append(evaluate_model(model, scoring.x, scoring.y, pixels=UNIT))
        return plan.scores(answers)

    probe = AttackSuccess(Trigger(patch=1, target=1))
    scores = evaluate({probe.metric: probe.samples(x, y)})
    assert scores.probes == {"attack_success": pytest.approx(3 / 5, abs=1e-12)}
    assert scores.global_acc == pytest.approx(5 / 7)  # clean images: all called 0
    assert evaluate().probes == {}  # no trigger, no attack_success


# -- bad settings ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({}, r"attack.target is required: the class"),
        ({"target": -1}, r"target = -1: Input should be greater than or equal to 0"),
        ({"target": 0, "poison_fraction": 0}, r"poison_fraction = 0: Input should be greater"),
        ({"target": 0, "poison_fraction": 1.5}, r"poison_fraction = 1.5: Input should be less"),
        ({"target": 0, "patch": 0}, r"patch = 0: Input should be greater than or equal to 1"),
        ({"target": 0, "lambda": -1}, r"lambda = -1: Input should be greater than or equal"),
        ({"target": 0, "trigger": 3}, r"trigger is not one of its options"),
    ],
)
def test_bad_backdoor_settings_are_refused(options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        validate({"attack": {"kind": "backdoor", "fraction": 0.2, **options}})


# -- runs -----------------------------------------------------------------------------------------
def _uint8_dataset() -> Dataset:
    """Three classes of 3x8x8 images whose colour depends on the class."""
    rng = np.random.default_rng(0)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = np.arange(n, dtype=np.int64) % 3
        base = np.array([[60, 120, 200], [200, 60, 120], [120, 200, 60]])[y]
        noise = rng.integers(-50, 50, (n, 3, 8, 8))
        return np.clip(base[:, :, None, None] + noise, 0, 255).astype(np.uint8), y

    pixels = PixelNorm((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    return Dataset("tiny-rgb", *draw(120), *draw(60), 3, pixels=pixels)


def _config(rounds: int, **attack: object) -> dict:
    return {
        "algorithm": "fedavg",
        "model": {"name": "mlp"},
        "data": {"dataset": "digits", "num_clients": 4, "test_per_client": 10},
        "train": {"rounds": rounds, "clients_per_round": 4, "batch_size": 16, "lr": 0.1},
        "threads": 1,
        "device": "cpu",
        "attack": {"kind": "backdoor", "fraction": 0.5, "target": 0, "patch": 2, **attack}
        if attack
        else None,
    }


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_backdoored_run_reports_attack_success_and_a_clean_run_null(tmp_path, monkeypatch):
    ds = _uint8_dataset()
    monkeypatch.setattr(hetfl.assembly, "load_dataset", lambda cfg: ds)
    sim = build_simulation(
        validate(_config(2, **{"lambda": 2})), tmp_path / "bd", show_progress=False
    )
    summary = sim.run()
    rows = _rows(tmp_path / "bd")
    assert len(rows) == 2 and all(0.0 <= r["attack_success"] <= 1.0 for r in rows)
    assert summary["final"]["attack_success"] == rows[-1]["attack_success"]
    assert summary["best"]["attack_success"] == min(r["attack_success"] for r in rows)
    clean = build_simulation(validate(_config(1)), tmp_path / "clean", show_progress=False)
    clean.run()
    assert [r["attack_success"] for r in _rows(tmp_path / "clean")] == [None]


@pytest.mark.parametrize(
    ("attack", "floats", "match"),
    [
        (
            {"target": 3},
            False,
            r"attack.target = 3 is not a class of dataset 'tiny-rgb' \(classes 0..2",
        ),
        ({"target": 0, "patch": 9}, False, r"attack.patch = 9 is larger than the 8x8 images"),
        ({"target": 0}, True, r"holds floats without pixel statistics"),
    ],
)
def test_a_trigger_the_data_cannot_take_is_refused_at_set_up(
    attack: dict, floats: bool, match: str, tmp_path, monkeypatch
):
    ds = _uint8_dataset()
    if floats:
        ds = Dataset(
            "floats",
            ds.x_train.astype(np.float32),
            ds.y_train,
            ds.x_test.astype(np.float32),
            ds.y_test,
            3,
        )
    monkeypatch.setattr(hetfl.assembly, "load_dataset", lambda cfg: ds)
    with pytest.raises(ValueError, match=match):
        build_simulation(validate(_config(1, **attack)), tmp_path / "x", show_progress=False)
