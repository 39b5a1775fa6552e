"""DTFL: "Speed up Federated Learning in Heterogeneous Environment: A Dynamic Tiering
Approach" (§3, Algorithm 1, Eq. (5), App. A.3, A.5, A.7), with the authors' code
(mahmoudsajjadi/DTFL: `main.py`, `utils/TierScheduler.py`, `utils/fedavg.py`) where the
text is silent.

Reproduced: the model is cut into modules md1..md8 (`resnet-cifar`); a client in tier m
trains md1..md_m and tier m's auxiliary head on the head's cross-entropy (local-loss
training, `hetfl.core.local.split.LocalLoss`), sending each batch's activations and labels
to the server without waiting; the server trains a copy of md_{m+1}..md8 per client on them,
reset from the global model each round (`hetfl.core.server_copies`). Both sides use the
task's optimiser and lr (App. A.3: Adam, "the same hyperparameters for the client and
server sides"; the shipped configs set the code's AMSGrad, weight decay 5e-4, lr 1e-3),
fresh each round. Aggregation joins each client's part and its server copy into a full
model and averages every md tensor over all of the round's clients by n_k whatever their
tier, BatchNorm statistics included, and each tier's head uniformly over that tier's
clients (`aux<m>.*` are tier m's own global tensors; a tier without clients keeps its head).
The evaluated model is the aggregated md1..md8, without heads, also for `local_acc`. The
tier scheduler (`hetfl.algorithms.tier_scheduler`) assigns tiers each round from the
clients' simulated times and per-tier profiles of HetFL's cost model (`costs`).

Choices where the paper is silent or inconsistent: weights are n_k over the round's
participants (Alg. 1 line 12 prints 1/K, App. A.7 1/N; the code's n_k are computed after
drawing the next round's clients, which misaligns them under non-IID data: not copied);
T_max is computed and used in the same round over all seven tiers (the code uses the
previous round's and skips a tier); a round's time includes the server side by Eq. (5)
(the code's omits it). Options: `observed: compute` gives the scheduler the exact simulated
compute time instead of total minus estimated communication; `server_optimiser: batch`
re-creates the server's optimiser every batch, as the code does; `dcor_alpha` and
`patch_size` are the privacy measures of §4.2 (`hetfl.core.local.privacy`). The lr cut on a
plateau (App. A.3) is `train.lr_plateau`, any method's; docs/methods.md has the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator, model_validator

from hetfl.algorithms.base import Options, register_algorithm
from hetfl.algorithms.tier_scheduler import Observed, TierScheduler
from hetfl.core.assign import UniformSampling
from hetfl.core.local.parts import LocalRecipe
from hetfl.core.local.split import LocalLoss
from hetfl.core.server_copies import FreshOptimiser, ServerCopies
from hetfl.core.server_update import Averaged
from hetfl.core.spec import Spec
from hetfl.core.split_costs import SplitPricing
from hetfl.core.strategy import Strategy
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo, ClientResult, ClientTask, ModelFamily
from hetfl.models.resnet_cifar import TIERS, CifarResNetFamily


class DTFLOptions(Options):
    tiers: tuple[int, ...] = Field(TIERS, description="the tiers the scheduler may assign")
    default_tier: int = Field(2, description="the tier of a client without a history")
    observed: Observed = "total-minus-comm"
    server_optimiser: FreshOptimiser = "round"
    dcor_alpha: float = Field(0.0, ge=0, lt=1, allow_inf_nan=False)
    patch_size: int | None = Field(None, ge=1)

    @field_validator("tiers")
    @classmethod
    def _tiers_of_the_model(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        wrong = [m for m in v if m not in TIERS]
        if not v or wrong or len(set(v)) != len(v):
            raise ValueError(
                f"tiers must be distinct tiers of 1..7 (tier m: the client trains md1..md_m), "
                f"got {list(v)}"
            )
        return tuple(sorted(v))

    @model_validator(mode="after")
    def _default_is_a_tier(self) -> DTFLOptions:
        if self.default_tier not in self.tiers:
            raise ValueError(
                f"default_tier {self.default_tier} is not one of tiers {list(self.tiers)}; "
                "choose one of them"
            )
        return self


def split_family(family: ModelFamily) -> CifarResNetFamily:
    """The family of a model cut into modules, or the error that names the fix."""
    if not isinstance(family, CifarResNetFamily):
        raise ValueError(
            "dtfl cuts its model into a client and a server side: set model.name to "
            "resnet-cifar; the configured model cannot be split"
        )
    return family


def _tier_field(info: ClientInfo, task: ClientTask | None) -> Mapping[str, Any]:
    """The tier of a client asked to train, for its rows of the per-client trace."""
    return {} if task is None else {"tier": task.spec["tier"]}


@register_algorithm("dtfl", DTFLOptions, needs="split", needs_costs=True)
def _make(
    family: ModelFamily,
    opts: DTFLOptions,
    *,
    clients_per_round: int,
    train: LocalTraining,
    costs: SplitPricing,
) -> tuple[Strategy, LocalRecipe]:
    split = split_family(family)

    def client(tier: int) -> Spec:  # md1..md_tier and the tier's head
        return split.side_spec("client", tier, aux=True)

    def server(tier: int) -> Spec:  # md_(tier+1)..md8
        return split.side_spec("server", tier)

    profiles = {m: costs.cut_cost(client(m), server(m), train.batch_size) for m in opts.tiers}
    whole = split.side_spec("whole")
    main = [e.global_name for e in split.index_map(whole)]
    heads = [d.name for d in split.declared_tensors([client(m) for m in opts.tiers])]

    def weights(result: ClientResult) -> dict[str, float]:
        """n_k on every md tensor, 1 on the heads: each head's names are its tier's own."""
        return dict.fromkeys(main, float(result.num_examples)) | dict.fromkeys(heads, 1.0)

    strategy = Strategy(
        family,
        train=train,
        sampler=UniformSampling(clients_per_round),
        assignment=TierScheduler(
            profiles,
            costs.server_rate,
            client,
            lambda spec: int(spec["tier"]),
            whole,
            train,
            default_tier=opts.default_tier,
            observed=opts.observed,
        ),
        weighting=weights,
        server_update=Averaged(),
        server_side=ServerCopies(
            family,
            lambda spec: server(spec["tier"]),
            parallel=True,
            fresh_optimiser=opts.server_optimiser,
        ),
        describe=lambda: {
            **opts.model_dump(mode="json"),
            "profiles": {f"tier {m}": cost.summary() for m, cost in profiles.items()},
        },
        trace_fields=_tier_field,
    )
    local = LocalLoss(opts.dcor_alpha, opts.patch_size)
    return strategy, LocalRecipe(forward=local, loss_terms=(local.dcor,))
