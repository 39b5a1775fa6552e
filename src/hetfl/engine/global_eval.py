"""A round's global evaluation as a list of scorings, and their answers as `GlobalScores`.

The strategy names the models to test (`Strategy.eval_models`), each with its tensors as
tested (after its BatchNorm statistics pass, `RoundLoop.tested_models`). What they are
scored on, every model on the global test set and the main one (the first) also on the
pooled validation samples and on each probe's samples (`hetfl.core.probe`: a backdoor's
triggered test images), is planned here as plain `Scoring`s, so that an engine answers
all of them together with the round's local evaluations (`RoundLoop.score_round`: the
simulator in one exchange of its executor, however many models the round tests), and the
answers become `GlobalScores` here, in the order the plan gave them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from hetfl.core.types import EvalModel, State
from hetfl.engine.steps import GlobalScores, Pooled

#: (correct, summed loss, count) of one model on one set of samples.
Score = tuple[int, float, int]

#: Each probe's samples by its metric (`hetfl.core.probe.Probe.samples`), made once.
ProbeSamples = Mapping[str, tuple[torch.Tensor, torch.Tensor]]


class Scoring(NamedTuple):
    """`model` (its tensors as tested) scored on (x, y)."""

    model: EvalModel
    x: torch.Tensor
    y: torch.Tensor


@dataclass(frozen=True)
class GlobalPlan:
    """The scorings of a round's tested models, in this order: each model on the test set;
    then the main model on each pooled validation set, then on each probe's samples."""

    tested: Sequence[EvalModel]
    scorings: list[Scoring]
    validation_sets: int
    probes: tuple[str, ...]

    def scores(self, answers: Sequence[Score]) -> GlobalScores:
        """The answers (one per scoring, in order) as the round's `GlobalScores`: the main
        model's accuracy and loss, each grouped model's accuracy (a `mean_group` the
        unweighted mean of its models'), the validation scores pooled over every sample, the
        share of each probe's samples classified as labelled (`attack_success`)."""
        scores = GlobalScores()
        if not self.tested:
            return scores
        tests, rest = answers[: len(self.tested)], answers[len(self.tested) :]
        means: dict[str, list[float]] = {}
        for em, (correct, _, n) in zip(self.tested, tests, strict=True):
            scores.models[em.name] = em.tensors
            if em.group is not None:
                scores.groups[em.group] = {"acc": correct / n, "n": n}
            if em.mean_group is not None:
                means.setdefault(em.mean_group, []).append(correct / n)
        correct, loss_sum, n = tests[0]
        scores.global_acc, scores.test_loss = correct / n, loss_sum / n
        for group, accs in means.items():
            scores.groups[group] = {"acc": sum(accs) / len(accs), "n": n}
        validation = rest[: self.validation_sets]
        if validation:
            pooled = sum(t[2] for t in validation)
            scores.val_acc = sum(t[0] for t in validation) / pooled
            scores.val_loss = sum(t[1] for t in validation) / pooled
        probed = rest[self.validation_sets :]
        for metric, (hits, _, m) in zip(self.probes, probed, strict=True):
            scores.probes[metric] = hits / m
        return scores


def plan_global(
    tested: Sequence[EvalModel],
    test: tuple[torch.Tensor, torch.Tensor],
    validation: Pooled,
    probes: ProbeSamples,
) -> GlobalPlan:
    """The scorings of `tested` (the first is `global_acc`'s model): on the global `test`
    set, and the main model on the pooled `validation` samples and on each probe's samples
    (a probe with none is not scored: its metric stays null)."""
    scorings = [Scoring(em, *test) for em in tested]
    scored = tuple(m for m, (_, y) in probes.items() if y.numel()) if tested else ()
    if tested:
        main = tested[0]
        scorings += [Scoring(main, x, y) for x, y in validation]
        scorings += [Scoring(main, *probes[m]) for m in scored]
    return GlobalPlan(tested, scorings, len(validation) if tested else 0, scored)


def as_tested(model: nn.Module) -> State:
    """A copy of a loaded model's tensors: what was tested, kept while the engine's model
    of its spec is loaded with another model's."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
