"""A pretrained base for LoRA fine-tuning: the configured model trained centrally on the
training samples the run's partition deals to no client, saved as a state dict for the
LoRA methods' `pretrained` option (docs/methods.md, "Heterogeneous-rank LoRA").

With the `natural` partition and fewer clients than owners (pydoc-topics has 79
documents), the unused owners' documents are a part of the corpus the federation never
sees, so pretraining on them and fine-tuning on the clients' documents is the
pretrain-then-fine-tune protocol of issue 54's study. Training is the one local loop
(`hetfl.core.client.program.ClientProgram.fit`) on one pooled client, with the run's
`train` settings except the number of steps.

    python -m hetfl.pretrain CONFIG OUT.pt --steps 200
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from hetfl.assembly import load_dataset, partition
from hetfl.config import RunConfig
from hetfl.config.loading import load_raw, validate
from hetfl.core.client.program import Programs
from hetfl.core.init import build_model, initialize
from hetfl.core.rng import SERVER, torch_generator
from hetfl.core.spec import full_map
from hetfl.core.types import ClientData, ClientTask
from hetfl.models import make_family

#: The client id of the pooled pretraining data (no client of a run has it).
POOLED = -1


def unused_samples(cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(x, y) of the training samples `cfg`'s partition deals to no client, and the
    dataset's number of classes."""
    dataset = load_dataset(cfg)
    used = np.concatenate(partition(cfg, dataset))
    rest = np.setdiff1d(np.arange(len(dataset.y_train)), used)
    if rest.size == 0:
        raise ValueError(
            f"pretrain: {cfg.data.partition.kind} deals every training sample of "
            f"{cfg.data.dataset} to a client, so none is left to pretrain on; use "
            "data.partition.kind natural with fewer data.num_clients than owners"
        )
    x = torch.as_tensor(dataset.x_train[rest])
    return x, torch.as_tensor(dataset.y_train[rest]).long(), dataset.num_classes


def pretrain_base(cfg: RunConfig, steps: int, out: str | Path) -> Path:
    """The configured model (at its base spec) trained for `steps` steps of `cfg.train`'s
    optimiser on `unused_samples(cfg)`, from the (seed, "pretrain") initialisation; its
    state dict saved to `out`."""
    if steps < 1:
        raise ValueError(f"pretrain: steps must be >= 1, got {steps}")
    x, y, classes = unused_samples(cfg)
    family = make_family(cfg.model.name, tuple(x.shape[1:]), classes, **cfg.model.family_options())
    spec = family.global_spec([])
    model = build_model(family, spec)
    state = initialize(model, torch_generator(cfg.seed, 0, SERVER, "pretrain")).state_dict()
    empty = x[:0]
    data = ClientData(POOLED, x, y, empty, y[:0], classes)
    train = replace(cfg.train.local_training(), steps=steps)
    task = ClientTask(POOLED, spec, dict(state), full_map(state), config=train)
    program = Programs(family, seed=cfg.seed).program_for(POOLED)
    generator = torch_generator(cfg.seed, 0, POOLED, "train")
    output = program.fit(task, data, {}, generator, info=data.info())
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.clone() for k, v in output.result.tensors.items()}, path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hetfl.pretrain", description=__doc__)
    parser.add_argument("config", help="the run's YAML config (its data, model and train)")
    parser.add_argument("out", help="where to save the base model's state dict")
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    args = parser.parse_args(argv)
    path = pretrain_base(validate(load_raw(args.config)), args.steps, args.out)
    print(f"pretrained base saved to {path}")


if __name__ == "__main__":
    main()
