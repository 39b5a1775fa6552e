"""The client program: local training with hooks, and local evaluation.

A client program is a pure function of (task, data, private state, generator): it builds the
model for the task's spec (cached per spec, loaded in place), loads the received tensors and
its private ones, trains, and splits its model into what it sends (the tensors named by the
task's index map) and what it keeps (everything else). Methods change local training only
through `ClientHooks`, which see parameter dictionaries, never the engine:

- `forward(model, x, y, ctx)` returns (outputs, per-sample loss) of a batch (widths,
  logit masks, auxiliary heads, several passes);
- `backward(total, ctx)` back-propagates (split learning exchanges with a server here);
- `loss(outputs, targets, per_sample_loss, ctx)` returns an extra loss term or None;
- `pre_step(grads, params, ctx)` edits gradients in place (FedProx's proximal term,
  masks, clipping);
- `post_step(params, ctx)` edits parameters in place after the step (projections such as
  singular-value thresholding);
- `on_batch(ctx)` is called after each step, e.g. to send the batch's activations to a
  server program without waiting (`ctx.send`, see `hetfl.core.server_program`);
- `finish(ctx)` returns the declared extras of the result (FedNova's normaliser).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.core.dropout import dropout_masks
from hetfl.core.init import build_model, initialize
from hetfl.core.rng import sibling_generator, torch_generator
from hetfl.core.roles import norm_tensor_names
from hetfl.core.server_program import Channel
from hetfl.core.spec import Spec, local_names
from hetfl.core.training import LocalTraining
from hetfl.core.types import (
    ClientData,
    ClientInfo,
    ClientOutput,
    ClientResult,
    ClientTask,
    EvalTask,
    ModelFamily,
    PassRecord,
    State,
)


@dataclass
class TrainContext:
    """What hooks may read and record during local training.

    `received` holds the tensors sent down; `params` the live parameters of `model`;
    `batch` the current (x, y); `state` is the hooks' own scratch space for this round.
    A hook that runs its own passes (FjORD's widths, knowledge distillation) appends a
    `PassRecord` per pass to `passes`; batches for which no hook recorded a pass are
    counted as one default training pass of the task's spec. `channel` is the link to this
    client's server program in split learning (None when the strategy has none). `info` is
    the client's `ClientInfo` as the engine holds it: what it declared in `attrs` and, under
    device profiles, its `attrs["sim_times"]` from the last round it trained.
    """

    task: ClientTask
    received: State
    generator: torch.Generator
    settings: LocalTraining
    info: ClientInfo | None = None
    model: nn.Module | None = None
    params: dict[str, nn.Parameter] = field(default_factory=dict)
    batch: tuple[torch.Tensor, torch.Tensor] | None = None
    step: int = 0
    passes: list[PassRecord] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    channel: Channel | None = None

    def send(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Send a batch's activations and labels to the server program; its answer (the
        gradient with respect to `z`, or None). Bytes both ways are counted by the channel."""
        if self.channel is None:
            raise RuntimeError(
                "this method exchanges activations with a server program every batch, but "
                "the engine gave no channel (the strategy's server_program returned None, or "
                "the engine cannot run server programs)"
            )
        return self.channel.send(z, y)


class ClientHooks:
    """Default hooks: plain local SGD. Methods subclass and override what they change."""

    def forward(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, ctx: TrainContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(outputs, per-sample loss) of one batch; FjORD passes a width, HeteroFL masks
        logits, DTFL trains an auxiliary head here."""
        outputs = model(x)
        return outputs, F.cross_entropy(outputs, y, reduction="none")

    def backward(self, total: torch.Tensor, ctx: TrainContext) -> None:
        """Back-propagate the batch loss; split learning replaces it with a server exchange."""
        total.backward()

    def loss(
        self,
        outputs: torch.Tensor,
        targets: torch.Tensor,
        per_sample_loss: torch.Tensor,
        ctx: TrainContext,
    ) -> torch.Tensor | None:
        return None

    def pre_step(
        self, grads: dict[str, torch.Tensor], params: Mapping[str, torch.Tensor], ctx: TrainContext
    ) -> None:
        return None

    def post_step(self, params: Mapping[str, torch.Tensor], ctx: TrainContext) -> None:
        return None

    def on_batch(self, ctx: TrainContext) -> None:
        return None

    def finish(self, ctx: TrainContext) -> dict[str, Any]:
        return {}


@dataclass
class LocalStats:
    """`samples_seen` counts samples over all steps (epochs x data size), unlike
    `ClientResult.num_examples`, the client's data size, which aggregation weights use.
    `default_passes` maps a batch size to the number of steps no hook recorded passes for."""

    num_steps: int
    samples_seen: int
    loss: float
    default_passes: dict[int, int]
    momentum: State = field(default_factory=dict)


def batch_order(n: int, settings: LocalTraining, generator: torch.Generator) -> list[torch.Tensor]:
    """Mini-batches of indices: a fresh permutation per epoch; the last batch may be short."""
    total = settings.num_steps(n)
    batches: list[torch.Tensor] = []
    while len(batches) < total:
        perm = torch.randperm(n, generator=generator)
        for start in range(0, n, settings.batch_size):
            batches.append(perm[start : start + settings.batch_size])
            if len(batches) == total:
                break
    return batches


def train_local(
    model: nn.Module,
    data: ClientData,
    hooks: ClientHooks,
    ctx: TrainContext,
    momentum: Mapping[str, torch.Tensor] | None = None,
) -> LocalStats:
    """SGD on the client's training data with the method's hooks.

    With `keep_momentum`, `momentum` holds the buffers the client kept from its previous
    round (by parameter name); a buffer whose shape no longer fits its parameter (the
    client got another sub-model) is dropped and that buffer starts afresh. The buffers
    after training come back in `LocalStats.momentum`."""
    settings = ctx.settings
    model.train()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    ctx.model, ctx.params = model, params
    optimizer = torch.optim.SGD(
        _decay_groups(model, params, settings.decay_norm_and_bias),
        lr=settings.lr,
        momentum=settings.momentum,
        weight_decay=settings.weight_decay,
        foreach=True,
    )
    if settings.keep_momentum:
        for k, p in params.items():
            buf = (momentum or {}).get(k)
            if buf is not None and buf.shape == p.shape:
                optimizer.state[p]["momentum_buffer"] = buf.to(p.device).clone()
    device = next(iter(params.values())).device
    loss_sum, seen = 0.0, 0
    default_passes: dict[int, int] = {}
    batches = batch_order(data.n_train, settings, ctx.generator)
    for step, idx in enumerate(batches):
        ctx.step = step
        idx = idx.to(device)
        x, y = data.x_train[idx], data.y_train[idx]
        ctx.batch = (x, y)
        recorded = len(ctx.passes)
        outputs, per_sample = hooks.forward(model, x, y, ctx)
        loss = per_sample.mean()
        extra = hooks.loss(outputs, y, per_sample, ctx)
        total = loss if extra is None else loss + extra
        optimizer.zero_grad(set_to_none=False)
        hooks.backward(total, ctx)
        grads = {k: p.grad for k, p in params.items() if p.grad is not None}
        hooks.pre_step(grads, params, ctx)
        if settings.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(list(params.values()), settings.clip_grad_norm)
        optimizer.step()
        hooks.post_step(params, ctx)
        hooks.on_batch(ctx)
        b = int(y.shape[0])
        if len(ctx.passes) == recorded:
            default_passes[b] = default_passes.get(b, 0) + 1
        loss_sum += float(loss.detach()) * b
        seen += b
    ctx.batch = None
    buffers = {
        k: buf.detach().clone()
        for k, p in params.items()
        if settings.keep_momentum
        and (buf := optimizer.state.get(p, {}).get("momentum_buffer")) is not None
    }
    return LocalStats(len(batches), seen, loss_sum / max(seen, 1), default_passes, buffers)


def _decay_groups(
    model: nn.Module, params: Mapping[str, torch.Tensor], decay_all: bool
) -> list[torch.Tensor] | list[dict[str, Any]]:
    """The optimiser's parameters: all in one group, or (without `decay_all`) normalisation
    tensors and biases in a group of their own with no weight decay. Both are found from the
    model's structure: norm modules (`hetfl.core.roles`) and each module's own `bias`."""
    if decay_all:
        return list(params.values())
    exempt = norm_tensor_names(model)
    for prefix, module in model.named_modules():
        if isinstance(getattr(module, "bias", None), nn.Parameter):
            exempt.add(f"{prefix}.bias" if prefix else "bias")
    decayed = [p for k, p in params.items() if k not in exempt]
    free = [p for k, p in params.items() if k in exempt]
    groups: list[dict[str, Any]] = [{"params": decayed}, {"params": free, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _merge_passes(records: list[PassRecord]) -> list[PassRecord]:
    """One record per (spec, kind, batch, width), counts summed, in first-seen order."""
    counts: dict[tuple[Any, ...], int] = {}
    for r in records:
        key = (r.spec, r.kind, r.batch, r.width)
        counts[key] = counts.get(key, 0) + r.count
    return [
        PassRecord(spec, kind, batch, count, width)
        for (spec, kind, batch, width), count in counts.items()
    ]


def mask_logits(outputs: torch.Tensor, labels: tuple[int, ...] | None) -> torch.Tensor:
    """Logits of the classes not in `labels` set to 0 (HeteroFL's and FedFA's masked
    cross-entropy: HeteroFL, ICLR 2021, §3, and its code `models/resnet.py`; FedFA,
    arXiv 2406.09877, §5.1; 0, not -inf, which would be a different loss)."""
    if labels is None:
        return outputs
    keep = torch.zeros(outputs.shape[-1], dtype=torch.bool, device=outputs.device)
    keep[list(labels)] = True
    return outputs.masked_fill(~keep, 0.0)


@torch.no_grad()
def evaluate_model(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int = 1000,
    label_mask: tuple[int, ...] | None = None,
) -> tuple[int, float, int]:
    """(correct, summed loss, count) of `model` on (x, y), in eval mode, with the logits of
    classes outside `label_mask` zeroed when it is given."""
    model.eval()
    correct, loss_sum = 0, 0.0
    for start in range(0, int(y.shape[0]), batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        out = mask_logits(model(xb), label_mask)
        loss_sum += float(F.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(dim=1) == yb).sum())
    return correct, loss_sum, int(y.shape[0])


#: The prefix of the names under which a client keeps its momentum buffers as private
#: state (`LocalTraining.keep_momentum`); state-dict names are module paths, never with "/".
MOMENTUM = "momentum/"


class ClientProgram:
    """The client side of a method: a model family, the method's hooks and a device.

    Models are built once per spec and re-used; received and private tensors are loaded
    in place. A client's private tensors at first participation come from a fresh
    initialisation drawn from the (seed, 0, client, "private-init") generator.
    """

    def __init__(
        self,
        family: ModelFamily,
        hooks: ClientHooks | None = None,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.family = family
        self.hooks = hooks or ClientHooks()
        self.seed = seed
        self.device = torch.device(device)
        self._models: dict[Spec, nn.Module] = {}

    def model_for(self, spec: Spec) -> nn.Module:
        model = self._models.get(spec)
        if model is None:
            model = build_model(self.family, spec).to(self.device)
            self._models[spec] = model
        return model

    def _load(
        self, cid: int, spec: Spec, payload: State, private: Mapping[str, torch.Tensor]
    ) -> nn.Module:
        """The model for `spec` with the payload, the client's private tensors and, for
        tensors in neither, the client's seeded initialisation. A private tensor that does
        not fit the model (the client got another sub-model) is an error naming the client
        and the tensor; kept momentum buffers (`MOMENTUM` names) are not loaded here and
        start afresh on a shape change (`train_local`)."""
        model = self.model_for(spec)
        shapes = {k: v.shape for k, v in model.state_dict().items()}
        names = set(shapes)
        missing = names - set(payload) - set(private)
        unknown = set(payload) - names
        if unknown:
            raise KeyError(f"payload names tensors the model for {spec} lacks: {sorted(unknown)}")
        misfit = sorted(k for k in names & set(private) if private[k].shape != shapes[k])
        if misfit:
            k = misfit[0]
            raise ValueError(
                f"client {cid}: its private tensor {k!r} has shape {tuple(private[k].shape)}, "
                f"but its model for this task ({spec}) needs {tuple(shapes[k])} (misfits: "
                f"{misfit}); a client keeps its private layers at the sub-model it last "
                "trained, so a strategy with private layers must not change a client's sub-model"
            )
        full: dict[str, torch.Tensor] = {}
        if missing:
            fresh = initialize(
                build_model(self.family, spec), torch_generator(self.seed, 0, cid, "private-init")
            ).state_dict()
            full.update({k: fresh[k] for k in missing})
        full.update({k: v for k, v in private.items() if k in names})
        full.update(payload)
        model.load_state_dict(full, strict=True)
        return model

    def fit(
        self,
        task: ClientTask,
        data: ClientData,
        private: Mapping[str, torch.Tensor],
        generator: torch.Generator,
        *,
        info: ClientInfo,
        channel: Channel | None = None,
    ) -> ClientOutput:
        """Train on `task`. `info` is the client's `ClientInfo` as the engine holds it (its
        declared attributes and, with device profiles, its `sim_times` from the last round
        it trained) and reaches the hooks as `ctx.info`; it is required so that no engine
        can hand the hooks a bare `data.info()`. `channel`, given by engines that run the
        strategy's server program, reaches the hooks as `ctx.channel`."""
        if info.cid != task.cid:
            raise ValueError(f"info is client {info.cid}'s, the task is for client {task.cid}")
        model = self._load(task.cid, task.spec, task.payload, private)
        settings = task.config
        ctx = TrainContext(
            task=task,
            received=task.payload,
            generator=generator,
            settings=settings,
            info=info,
            channel=channel,
        )
        kept_momentum = {
            k.removeprefix(MOMENTUM): v for k, v in private.items() if k.startswith(MOMENTUM)
        }
        with dropout_masks(model, sibling_generator(generator, "dropout", self.device)):
            stats = train_local(model, data, self.hooks, ctx, kept_momentum)
        state = model.state_dict()
        sent = set(local_names(task.index_map))
        tensors = {k: state[k].detach().clone() for k in local_names(task.index_map)}
        kept = {k: v.detach().clone() for k, v in state.items() if k not in sent}
        kept.update({MOMENTUM + k: v for k, v in stats.momentum.items()})
        passes = [
            PassRecord(spec=task.spec, kind="train", batch=b, count=c)
            for b, c in sorted(stats.default_passes.items())
        ] + _merge_passes(ctx.passes)
        result = ClientResult(
            cid=task.cid,
            tensors=tensors,
            num_examples=data.n_train,
            num_steps=stats.num_steps,
            loss=stats.loss,
            passes=passes,
            extras=self.hooks.finish(ctx),
        )
        return ClientOutput(result=result, private=kept)

    def evaluate(
        self, task: EvalTask, data: ClientData, private: Mapping[str, torch.Tensor]
    ) -> tuple[int, float, int]:
        """(correct, summed loss, count) on the client's split named by `task.split` (its
        local test split, or its validation split)."""
        model = self._load(task.cid, task.spec, task.payload, private)
        if task.stats_pass:
            recompute_bn_statistics(model, data.x_train)
        x, y = data.split(task.split)
        return evaluate_model(model, x, y, label_mask=task.label_mask)


#: Per BatchNorm layer (by module name): (sum of per-batch means, sum of per-batch unbiased
#: variances, number of batches), the sufficient statistics of a static-BN pass.
BNStatistics = dict[str, tuple[torch.Tensor, torch.Tensor, int]]


def _batch_norms(model: nn.Module) -> dict[str, nn.modules.batchnorm._BatchNorm]:
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    }


def _running_stats(
    m: nn.modules.batchnorm._BatchNorm,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(running_mean, running_var, num_batches_tracked) of `m`; the callers need a layer that
    tracks running statistics (PyTorch types them Optional for layers that do not)."""
    return (
        cast(torch.Tensor, m.running_mean),
        cast(torch.Tensor, m.running_var),
        cast(torch.Tensor, m.num_batches_tracked),
    )


def bn_batch_statistics(model: nn.Module, x: torch.Tensor, batch_size: int = 500) -> BNStatistics:
    """Sum each BatchNorm layer's per-batch statistics over one pass of `x` in train mode.

    Batches are consecutive slices of `x`. For each batch the layer's running statistics are
    reset and updated once with momentum None, so PyTorch's own kernel gives that batch's
    mean and unbiased variance, which are summed. Parts of one data set (clients' data) are
    combined by adding their sums (`apply_bn_statistics` divides). Normalisation in train
    mode uses batch statistics, so the resets do not change any layer's input. The model's
    momenta are restored and its running statistics are left as the last batch's.
    """
    norms = _batch_norms(model)
    saved = {k: m.momentum for k, m in norms.items()}
    sums = {k: [torch.zeros_like(s) for s in _running_stats(m)[:2]] for k, m in norms.items()}
    batches = 0
    model.train()
    with torch.no_grad():
        for start in range(0, int(x.shape[0]), batch_size):
            for m in norms.values():
                m.reset_running_stats()
                m.momentum = None
            model(x[start : start + batch_size])
            batches += 1
            for k, m in norms.items():
                mean, var, _ = _running_stats(m)
                sums[k][0] += mean
                sums[k][1] += var
    for k, m in norms.items():
        m.momentum = saved[k]
    return {k: (mean, var, batches) for k, (mean, var) in sums.items()}


@torch.no_grad()
def apply_bn_statistics(model: nn.Module, stats: BNStatistics) -> None:
    """Set each BatchNorm layer's running statistics to the cumulative average of `stats`
    (mean of the per-batch means and of the per-batch unbiased variances, as PyTorch's
    momentum None gives); the model is left in eval mode."""
    norms = _batch_norms(model)
    if set(stats) != set(norms):
        raise ValueError(
            f"BatchNorm statistics for layers {sorted(stats)}, the model has {sorted(norms)}"
        )
    for k, m in norms.items():
        mean, var, n = stats[k]
        if n < 1:
            raise ValueError(f"no batches for BatchNorm layer {k!r}")
        running_mean, running_var, tracked = _running_stats(m)
        running_mean.copy_(mean / n)
        running_var.copy_(var / n)
        tracked.fill_(n)
    model.eval()


def recompute_bn_statistics(model: nn.Module, x: torch.Tensor, batch_size: int = 500) -> None:
    """Re-estimate BatchNorm running statistics by one pass over `x` (HeteroFL's static BN).

    As HeteroFL's code does it: statistics are reset and accumulated with momentum None,
    PyTorch's cumulative average, so the running mean is the mean of the per-batch means and
    the running variance the mean of the per-batch unbiased variances (equal to the exact
    statistics of `x` only when it is one batch). Batches are consecutive slices of `x`, so
    the result is deterministic; the model is left in eval mode. It is
    `bn_batch_statistics` then `apply_bn_statistics`, which the Flower adapter splits
    between clients and server.
    """
    apply_bn_statistics(model, bn_batch_statistics(model, x, batch_size))
