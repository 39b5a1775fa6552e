"""FedNova: Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization" (NeurIPS 2020), Section 4 (Eq. 6-7), and the official code
(JYWa/FedNova, `distoptim/FedNova.py`), whose unnormalised server rule is followed below.

Reproduced: each client tracks the normaliser ‖a_k‖₁ of its local optimiser while it trains
— plain SGD: ‖a‖₁ = τ_k; momentum ρ: per step c ← ρc + 1, ‖a‖₁ += c; proximal μ: per step
‖a‖₁ ← ‖a‖₁(1 - η μ) + 1 — and returns it with its weights. The server forms
g_k = w - w_k (the cumulative, learning-rate-scaled update, weight decay included) and
applies the official *unnormalised* rule

    w ← w - τ_eff Σ_k p_k g_k / ‖a_k‖₁,   τ_eff = Σ_k p_k ‖a_k‖₁   (prox: Σ_k p_k τ_k)

with p_k ∝ n_k over the clients that answered. This is not a re-weighted FedAvg: Flower's
baseline passes p_k τ_eff / ‖a_k‖₁ to a normalising average, which agrees only when all
‖a_k‖₁ are equal. With equal step counts and plain SGD the rule is FedAvg.

Choices where the paper is silent: with both momentum and μ the momentum recursion runs
first, then the proximal one, as the official optimiser does; momentum buffers are fresh
each round (`LocalTraining` creates the optimiser per round), and `train.keep_momentum` is
refused: ‖a‖₁ counts only this round's gradients, which a carried buffer breaks; BatchNorm
running statistics and counters take the FedAvg average, since they are not optimised; the
official server momentum (`gmf`) is not provided — a server optimiser on the same
direction is (`hetfl.core.server_opt`, used by FedALRC).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from hetfl.algorithms.base import register_algorithm
from hetfl.algorithms.fedavg import Weighting
from hetfl.algorithms.fedopt import FedOpt
from hetfl.algorithms.fedprox import FedProxOptions
from hetfl.core.local.parts import LocalRecipe, TrainContext
from hetfl.core.local.terms import ProximalTerm
from hetfl.core.server_opt import ServerOptSettings
from hetfl.core.state import Accumulator, extract
from hetfl.core.strategy import Strategy
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientResult, ModelFamily, State


@dataclass(frozen=True, eq=False)
class StepNormaliser:
    """A tracker of ‖a‖₁ step by step for SGD with momentum and a proximal term of weight
    `mu` (0 without one); `finish` gives the result's `a_norm` and `steps` extras."""

    mu: float = 0.0

    @staticmethod
    def advance(
        a_norm: float, counter: float, momentum: float, lr_mu: float
    ) -> tuple[float, float]:
        """One local step of the ‖a‖₁ recursion: returns (‖a‖₁, momentum counter)."""
        if momentum != 0:
            counter = counter * momentum + 1
            a_norm += counter
        if lr_mu != 0:
            a_norm = a_norm * (1 - lr_mu) + 1
        if momentum == 0 and lr_mu == 0:
            a_norm += 1
        return a_norm, counter

    def after_step(self, ctx: TrainContext) -> None:
        own = ctx.scratch(self)
        a_norm, counter = own.get("a_norm", 0.0), own.get("counter", 0.0)
        lr_mu = ctx.settings.lr * self.mu
        own["a_norm"], own["counter"] = self.advance(a_norm, counter, ctx.settings.momentum, lr_mu)
        own["steps"] = own.get("steps", 0) + 1

    def finish(self, ctx: TrainContext) -> dict[str, Any]:
        own = ctx.scratch(self)
        return {"a_norm": own["a_norm"], "steps": own["steps"]}


class FedNova(FedOpt):
    name = "fednova"

    def __init__(
        self,
        family: ModelFamily,
        *,
        clients_per_round: int,
        train: LocalTraining,
        mu: float = 0.0,
        weighting: Weighting = "samples",
        server: ServerOptSettings | None = None,
    ) -> None:
        super().__init__(
            family,
            clients_per_round=clients_per_round,
            train=train,
            server=server or ServerOptSettings(kind="sgd", lr=1.0),
            weighting=weighting,
        )
        if train.keep_momentum:
            raise ValueError(
                f"{self.name} normalises by ‖a‖₁, which assumes momentum buffers start at zero "
                "each round; train.keep_momentum cannot be used with it"
            )
        self.mu = mu

    def direction(self, results: Sequence[ClientResult], average: State) -> State:
        """-τ_eff Σ p_k g_k / ‖a_k‖₁ on every parameter (zero where no client covers it)."""
        params = set(self.parameter_names())
        total = sum(self.client_weight(r) for r in results)
        acc = Accumulator(self.global_state)
        tau_eff = 0.0
        for r in results:
            a_norm, steps = _normaliser(r)
            weight = self.client_weight(r)
            tau_eff += weight / total * (steps if self.mu > 0 else a_norm)
            imap = [e for e in self.result_map(r) if e.global_name in params]
            sent = extract(self.global_state, imap)
            update = {k: sent[k] - r.tensors[k] for k in sent}
            acc.add(update, imap, weight=weight, scale={e.global_name: 1 / a_norm for e in imap})
        normalised = acc.result(self.global_state, fill="zero")
        return {k: -tau_eff * normalised[k] for k in params}


def require_sgd(name: str, train: LocalTraining) -> None:
    """FedNova's ‖a‖₁ is SGD's (§4, Eq. 6-7 for SGD, momentum and proximal SGD); refuse
    another local optimiser rather than normalise by the wrong count."""
    if train.optimizer != "sgd":
        raise ValueError(
            f"{name} normalises by the ‖a‖₁ of local SGD, got train.optimizer = "
            f"{train.optimizer!r}; use optimizer 'sgd'"
        )


def _normaliser(result: ClientResult) -> tuple[float, int]:
    try:
        a_norm, steps = float(result.extras["a_norm"]), int(result.extras["steps"])
    except KeyError as exc:
        raise KeyError(
            f"client {result.cid} returned no FedNova normaliser {exc}; its program must use "
            "the StepNormaliser tracker"
        ) from None
    if not a_norm > 0:
        raise ValueError(f"client {result.cid} returned normaliser {a_norm}; need > 0")
    return a_norm, steps


class FedNovaOptions(FedProxOptions):
    mu: float = Field(0.0, ge=0, description="proximal weight (FedNova-Prox when > 0)")


@register_algorithm(
    "fednova", "FedNova (Wang et al. 2020): normalised averaging of local updates", FedNovaOptions
)
def _make(
    family: ModelFamily, opts: FedNovaOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    require_sgd("fednova", train)
    strategy = FedNova(
        family,
        clients_per_round=clients_per_round,
        train=train,
        mu=opts.mu,
        weighting=opts.weighting,
    )
    prox = (ProximalTerm(opts.mu),) if opts.mu > 0 else ()
    return strategy, LocalRecipe(grad_transforms=prox, trackers=(StepNormaliser(opts.mu),))
