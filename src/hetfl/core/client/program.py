"""The client program: one client's local training and local evaluation.

A client program is a pure function of (task, data, private state, generator): it puts
together the client's tensors for the task's spec (the payload, its private tensors and,
for tensors in neither, its seeded initialisation), trains them with the method's
`LocalRecipe` (`hetfl.core.client`) on the shared per-spec template of a `ModelCache`, and
splits them into what it sends (the tensors named by the task's index map) and what it
keeps (everything else, and with `keep_momentum` the optimiser's state).

Engines get one program per client from `Programs.program_for(cid)`. Programs are light:
they share the factory's training cache (`hetfl.core.model_cache`), whose models are
stateless templates (called through `torch.func.functional_call`), so memory does not grow
with the number of clients.
`Programs` applies its wrappers to each honest program, so that a wrapper (an attack, a
fault) can change what one client does; it refuses a wrapper that cannot be pickled (the
process executor sends the programs, wrappers included, to its workers). Evaluation loads
tensors into models, so it uses a cache of its own, which the engine owns and passes in.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from hetfl.core.client.bn_statistics import recompute_bn_statistics
from hetfl.core.client.dropout import dropout_masks
from hetfl.core.client.loop import LocalStats, train_local
from hetfl.core.client.recipe import LocalRecipe, TrainContext
from hetfl.core.client.scoring import evaluate_model
from hetfl.core.client.trainable import split_trainable
from hetfl.core.init import build_model, initialize
from hetfl.core.model_cache import ModelCache
from hetfl.core.rng import sibling_generator, torch_generator
from hetfl.core.roles import tensor_roles
from hetfl.core.server_program import Channel
from hetfl.core.spec import Spec, local_names
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


class Program(Protocol):
    """What an engine runs for one client: `fit` a task, `evaluate` a model."""

    cid: int
    device: torch.device

    def fit(
        self,
        task: ClientTask,
        data: ClientData,
        private: Mapping[str, torch.Tensor],
        generator: torch.Generator,
        *,
        info: ClientInfo,
        channel: Channel | None = None,
    ) -> ClientOutput: ...

    def evaluate(
        self,
        task: EvalTask,
        data: ClientData,
        private: Mapping[str, torch.Tensor],
        models: ModelCache,
    ) -> tuple[float, float, int]: ...


#: Takes a client's program and returns the one to run instead (an attack, a fault).
Wrapper = Callable[[Program], Program]


class ClientProgram:
    """The honest client side of a method for client `cid`: a model family, the method's
    recipe, the run's seed, a device and the shared training cache `models`.

    A client's private tensors at first participation come from a fresh initialisation
    drawn from the (seed, 0, client, "private-init") generator.
    """

    def __init__(
        self,
        cid: int,
        family: ModelFamily,
        recipe: LocalRecipe,
        *,
        models: ModelCache,
        seed: int = 0,
    ) -> None:
        if models.family is not family:
            raise ValueError("the model cache is for another model family than the program's")
        self.cid = cid
        self.family = family
        self.recipe = recipe
        self.seed = seed
        self.models = models
        self.device = models.device

    def _state(
        self, spec: Spec, template: nn.Module, payload: State, private: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Every state-dict tensor of `spec`'s model for this client: the payload, its
        private tensors and, for tensors in neither, its seeded initialisation (not
        copied). A private tensor that does not fit the model (the client got another
        sub-model) is an error naming the client and the tensor; kept optimiser state is
        not a model tensor and is not read here."""
        shapes = {k: v.shape for k, v in template.state_dict().items()}
        missing = set(shapes) - set(payload) - set(private)
        unknown = set(payload) - set(shapes)
        if unknown:
            raise KeyError(f"payload names tensors the model for {spec} lacks: {sorted(unknown)}")
        misfit = sorted(k for k in set(shapes) & set(private) if private[k].shape != shapes[k])
        if misfit:
            k = misfit[0]
            raise ValueError(
                f"client {self.cid}: its private tensor {k!r} has shape "
                f"{tuple(private[k].shape)}, but its model for this task ({spec}) needs "
                f"{tuple(shapes[k])} (misfits: {misfit}); a client keeps its private layers "
                "at the sub-model it last trained, so a strategy with private layers must not "
                "change a client's sub-model"
            )
        fresh: Mapping[str, torch.Tensor] = {}
        if missing:
            generator = torch_generator(self.seed, 0, self.cid, "private-init")
            fresh = initialize(build_model(self.family, spec), generator).state_dict()
        return {
            k: payload[k] if k in payload else private[k] if k in private else fresh[k]
            for k in shapes
        }

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
        declared attributes and, with device profiles, its `history` from the last round it
        trained) and reaches the parts as `ctx.info`; it is required so that no engine
        can hand the parts a bare `data.info()`. `channel`, given by engines that run the
        strategy's server program, reaches the parts as `ctx.channel`."""
        template = self.models.model_for(task.spec)
        own = self.own_tensors(task, info, private)
        params, buffers = split_trainable(template, own)
        ctx = TrainContext(
            task=task,
            received=task.payload,
            generator=generator,
            settings=task.config,
            info=info,
            params=params,
            buffers=buffers,
            channel=channel,
            roles=tensor_roles(template),
        )
        with dropout_masks(template, sibling_generator(generator, "dropout", self.device)):
            stats = train_local(template, data, self.recipe, ctx, dict(private))
        return self.output(task, data, own, stats, ctx.passes)

    def own_tensors(
        self, task: ClientTask, info: ClientInfo, private: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The client's own copy, on the program's device, of every state-dict tensor of
        `task`'s model, for its training to update in place (`fit`; the vectorised executor,
        `hetfl.sim.vectorised`, stacks several clients' copies and trains them at once)."""
        if not info.cid == task.cid == self.cid:
            raise ValueError(
                f"client {self.cid}'s program got a task for client {task.cid} and the info "
                f"of client {info.cid}"
            )
        template = self.models.model_for(task.spec)
        state = self._state(task.spec, template, task.payload, private)
        return {k: v.detach().to(self.device, copy=True) for k, v in state.items()}

    def output(
        self,
        task: ClientTask,
        data: ClientData,
        own: Mapping[str, torch.Tensor],
        stats: LocalStats,
        recorded: Sequence[PassRecord] = (),
    ) -> ClientOutput:
        """The answer to `task` once `own` (`own_tensors`) is trained: the tensors the index
        map names are sent, the others and the optimiser state `stats` holds are kept.
        `recorded` are the passes parts recorded (`TrainContext.passes`)."""
        sent = local_names(task.index_map)
        tensors = {k: own[k].detach() for k in sent}
        kept = {k: v.detach() for k, v in own.items() if k not in tensors}
        kept.update(stats.optimiser_state)
        passes = [
            PassRecord(spec=task.spec, kind="train", batch=b, count=c)
            for b, c in sorted(stats.default_passes.items())
        ] + _merge_passes(list(recorded))
        result = ClientResult(
            cid=task.cid,
            tensors=tensors,
            num_examples=data.n_train,
            num_steps=stats.num_steps,
            loss=stats.loss,
            passes=passes,
            extras=stats.extras,
            uploads=stats.uploads,
        )
        return ClientOutput(result=result, private=kept)

    def evaluate(
        self,
        task: EvalTask,
        data: ClientData,
        private: Mapping[str, torch.Tensor],
        models: ModelCache,
    ) -> tuple[float, float, int]:
        """(correct, summed loss, count) on the client's split named by `task.split` (its
        local test split, or its validation split), with the model loaded into the
        evaluation cache `models` (the engine's); with the recipe's `scoring` (a
        detector's), its score summed over the split in place of the correct count."""
        model = models.model_for(task.spec)
        model.load_state_dict(self._state(task.spec, model, task.payload, private), strict=True)
        if task.stats_pass:
            recompute_bn_statistics(model, data.x_train, pixels=data.pixels)
        x, y = data.split(task.split)
        if self.recipe.scoring is not None:
            return self.recipe.scoring(model, x, y, task.spec, data.num_classes, data.pixels)
        return evaluate_model(model, x, y, label_mask=task.label_mask, pixels=data.pixels)


class Programs:
    """The run's client programs: `program_for(cid)` is client `cid`'s honest
    `ClientProgram` passed through `wrappers` in order. All share one training cache.

    Every wrapper must pickle (docs/contracts.md §1.3): one that does not is a ValueError
    here, before any worker is given the programs."""

    def __init__(
        self,
        family: ModelFamily,
        recipe: LocalRecipe | None = None,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        wrappers: Sequence[Wrapper] = (),
    ) -> None:
        self.family = family
        self.recipe = recipe or LocalRecipe()
        self.seed = seed
        self.models = ModelCache(family, device)
        self.device = self.models.device
        self.wrappers = tuple(wrappers)
        for wrap in self.wrappers:
            check_picklable(wrap)

    def program_for(self, cid: int) -> Program:
        program: Program = ClientProgram(
            cid, self.family, self.recipe, models=self.models, seed=self.seed
        )
        for wrap in self.wrappers:
            program = wrap(program)
        return program


def check_picklable(wrap: Wrapper) -> None:
    """ValueError, naming the wrapper, unless `wrap` pickles: the process executor sends the
    run's `Programs` to its worker processes."""
    try:
        pickle.dumps(wrap)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ValueError(
            f"client-program wrapper {_qualified_name(wrap)} cannot be pickled ({exc}); the "
            "process executor sends the programs, wrappers included, to its worker processes. "
            "A lambda, a local function or a local class cannot be pickled: define the wrapper "
            "(and the program it returns) at module level, e.g. as a frozen dataclass"
        ) from None


def _qualified_name(obj: object) -> str:
    """`module.qualname` of a function or class, else of the object's class."""
    named = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(named, '__module__', '?')}.{getattr(named, '__qualname__', '?')}"
