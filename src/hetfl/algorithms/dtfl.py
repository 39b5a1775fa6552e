"""DTFL: "Speed up Federated Learning in Heterogeneous Environment: A Dynamic Tiering
Approach" (§3, Algorithm 1, Eq. (5), App. A.3, A.5, A.7), with the authors' code
(mahmoudsajjadi/DTFL: `main.py`, `utils/TierScheduler.py`, `utils/fedavg.py`) where the
text is silent.

Reproduced: a client in tier m trains modules md1..md_m of `resnet-cifar` and tier m's
auxiliary head on the head's cross-entropy (`hetfl.algorithms.parts.dtfl_local_loss.LocalLoss`),
sending each batch's activations and labels to the server without waiting; the server
trains a copy of md_{m+1}..md8 per client on them, reset from the global model each round
(`hetfl.algorithms.parts.server_copies`). Both sides use the task's optimiser and lr, fresh
each round (App. A.3: "the same hyperparameters for the client and server sides"; the configs set
the code's AMSGrad, lr 1e-3, weight decay 5e-4). Every md tensor (BatchNorm statistics
included) is averaged over the round's clients by n_k whatever their tier, each client
contributing its part and its server copy; each head `aux<m>.*` uniformly over its tier's
clients, kept by a tier without clients. The aggregated md1..md8 without heads is
evaluated, also for `local_acc`. The tier scheduler (`hetfl.algorithms.parts.tier_scheduler`)
assigns tiers from the clients' simulated times and per-tier profiles of HetFL's cost
model (`costs`). Simulator-only.

Choices where the paper is silent or inconsistent: weights are n_k over the round's
participants (Alg. 1 line 12 prints 1/K, App. A.7 1/N; the code's n_k are computed after
drawing the next round's clients, which misaligns them under non-IID data: not copied);
T_max is computed and used in the same round over all seven tiers (the code uses the
previous round's and skips a tier); a round's time includes the server side by Eq. (5)
(the code's omits it). The options (`observed`, `on_profile_change`, `server_optimiser`, the
privacy measures `dcor_alpha` and `patch_size`) and the lr plateau: docs/methods.md.
"""

from __future__ import annotations

from functools import partial

from pydantic import Field

from hetfl.algorithms.parts.dtfl_local_loss import LocalLoss
from hetfl.algorithms.parts.method_registry import register_algorithm
from hetfl.algorithms.parts.option_records import TierSchedulerOptions
from hetfl.algorithms.parts.server_copies import CopiesSide, FreshOptimiser
from hetfl.algorithms.parts.tier_scheduler import PricedCuts, TierScheduler
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.pricing import SplitPricing
from hetfl.core.server.assign import UniformSampling
from hetfl.core.server.strategy import Aggregation, Extras, Strategy
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientResult, ModelFamily
from hetfl.models.resnet_cifar import split_family


class DTFLOptions(TierSchedulerOptions):
    server_optimiser: FreshOptimiser = Field(
        "round", description="a server copy's optimiser is fresh each round, or each batch"
    )
    dcor_alpha: float = Field(
        0.0, ge=0, lt=1, allow_inf_nan=False, description="alpha of (1-alpha)CE + alpha DCor(x, z)"
    )
    patch_size: int | None = Field(
        None, ge=1, description="shuffle the sent activations in patches of this size (off)"
    )

    def paper_rule(self) -> set[str]:  # described as before the options (the golden runs)
        unchanged = {"on_profile_change": "keep", "no_history": "default-tier"}
        return {k for k, v in unchanged.items() if getattr(self, k) == v}


@register_algorithm(
    "dtfl",
    DTFLOptions,
    needs="split",
    needs_costs=True,
    simulator_only="its server trains on each batch's activations (split learning), which "
    "the Flower adapter does not carry yet",
)
def _make(
    family: ModelFamily,
    opts: DTFLOptions,
    *,
    clients_per_round: int,
    train: LocalTraining,
    costs: SplitPricing,
) -> tuple[Strategy, LocalRecipe]:
    split = split_family(family, "dtfl")

    client = partial(split.side_spec, "client", aux=True)  # tier m: md1..md_m and its head
    profiles = PricedCuts(
        opts.tiers,
        lambda m: costs.cut_cost(client(m), split.server_spec(client(m)), train.batch_size),
    )
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
            on_profile_change=opts.on_profile_change,
            no_history=opts.no_history,
        ),
        aggregation=Aggregation(weighting=weights),
        extras=Extras(
            server_side=CopiesSide(
                family,
                split.server_spec,
                answers=False,
                parallel=True,
                fresh_optimiser=opts.server_optimiser,
            ),
            describe=lambda: {
                **opts.model_dump(mode="json", exclude=opts.paper_rule()),
                "profiles": {f"tier {m}": cost.summary() for m, cost in profiles.items()},
            },
            # a sampled client's tier, in its rows of the per-client trace (clients.jsonl)
            trace_fields=lambda info, task: {} if task is None else {"tier": task.spec["tier"]},
        ),
    )
    local = LocalLoss(opts.dcor_alpha, opts.patch_size)
    return strategy, LocalRecipe(forward=local, loss_terms=(local.dcor,))
