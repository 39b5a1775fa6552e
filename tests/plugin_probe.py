"""Run by tests/test_plugins.py in a fresh interpreter (never collected): a process that
imports plugins. `python plugin_probe.py WORK_DIR`, from the repository's root, runs the
example through `hetfl run` into WORK_DIR/runs, then checks what else a plugin reaches, and
writes its findings to WORK_DIR/probe.json.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import torch

from hetfl import cli
from hetfl.config import ConfigError, validate

EXAMPLE_MODULE = "hetfl_plugin_fedavgm_plugin"


def refused(raw: dict[str, Any]) -> str | None:
    """The ConfigError's message validating `raw`, None if it validates."""
    try:
        validate(raw)
    except ConfigError as exc:
        return str(exc)
    return None


def fedavgm_steps(server_lr: float, momentum: float, rounds: int) -> dict[str, Any]:
    """The example's server update over `rounds` rounds of made-up averages, against Hsu et
    al.'s v <- beta v + (w - avg), w <- w - eta v, written out here (float64)."""
    from hetfl.api import ALGORITHMS, Accumulator, LocalTraining, RoundResults
    from hetfl.models import make_family

    family = make_family("tiny-mlp", (1, 8, 8), 10)
    options = {"server_lr": server_lr, "momentum": momentum}
    strategy, _ = ALGORITHMS.get("fedavgm").build(
        family, options, clients_per_round=2, train=LocalTraining()
    )
    gen = torch.Generator().manual_seed(0)
    names = list(family.build(family.global_spec([])).state_dict())
    w = {n: torch.randn(3, generator=gen, dtype=torch.float64) for n in names}
    expected = {n: t.clone() for n, t in w.items()}
    v = {n: torch.zeros(3, dtype=torch.float64) for n in names}
    gaps = []
    for _ in range(rounds):
        average = {n: torch.randn(3, generator=gen, dtype=torch.float64) for n in names}
        done = RoundResults((), (), (), names, Accumulator)
        w = strategy.aggregation.server_update.step(w, average, done)
        for n in names:
            v[n] = momentum * v[n] + (expected[n] - average[n])
            expected[n] = expected[n] - server_lr * v[n]
        gaps.append(max(float((w[n] - expected[n]).abs().max()) for n in names))
    return {"max_gap": max(gaps), "rounds": len(gaps)}


def sign_flip_upload() -> dict[str, Any]:
    """The attack example, loaded as a plugin and chosen by `attack:`, around a real client
    of a CNN with BatchNorm: its upload against received − λ·(trained − received) on every
    parameter, written out here from the honest client's upload for the same inputs, and
    its buffers against the honest ones."""
    from hetfl.core.client.program import Programs
    from hetfl.core.init import initialize
    from hetfl.core.rng import SERVER, torch_generator
    from hetfl.core.training import LocalTraining
    from hetfl.core.types import ClientData, ClientTask
    from hetfl.models.scalable import ScalableFamily

    plugin = "examples/plugin/sign_flip_plugin.py"
    cfg = validate(
        {
            "plugins": [plugin],
            "data": {"num_clients": 4},
            "train": {"clients_per_round": 4},
            "attack": {"kind": "sign-flip", "fraction": 0.25, "lambda": 2},
        }
    )
    assert cfg.attack is not None
    attack = cfg.attack.chosen.build()
    family = ScalableFamily(
        {"family": "stage-cnn", "input_shape": (1, 8, 8), "num_classes": 3, "stages": 1}
    )
    spec = family.global_spec([])
    model = initialize(family.build(spec), torch_generator(0, 0, SERVER, "init"))
    payload = {k: v.clone() for k, v in model.state_dict().items()}
    task = ClientTask(0, spec, payload, family.index_map(spec), LocalTraining(lr=0.1, steps=2))
    x = torch.rand(6, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    data = ClientData(0, x, torch.tensor([0, 1, 2, 0, 1, 2]), x[:0], torch.tensor([]), 3)

    def upload(program: Any) -> dict[str, torch.Tensor]:
        gen = torch_generator(0, 1, 0, "train")
        return program.fit(task, data, {}, gen, info=data.info()).result.tensors

    honest = upload(Programs(family, seed=0).program_for(0))
    attacked = upload(attack(Programs(family, seed=0).program_for(0)))
    params = {k for k, _ in model.named_parameters()}
    gap = max(
        float((attacked[k] - (payload[k] - 2 * (honest[k] - payload[k]))).abs().max())
        for k in params
    )
    return {
        "kind": cfg.attack.kind,
        "described": cfg.attack.describe(),
        "parameter_gap": gap,
        "moved": all(not torch.equal(attacked[k], honest[k]) for k in params),
        "buffers_as_trained": all(
            torch.equal(attacked[k], honest[k]) for k in honest if k not in params
        ),
        "under_wrappers": refused(
            {"plugins": [plugin], "wrappers": [{"kind": "sign-flip", "lambda": 2}]}
        ),
    }


def main(work: Path) -> None:
    out: dict[str, Any] = {"imported_at_start": EXAMPLE_MODULE in sys.modules}

    # hetfl run: the example config (its plugin relative to the config's folder, not the
    # current directory), as a sweep over the two CPU executors, two rounds
    example = Path("examples/plugin/config.yaml").resolve()
    run = ["run", str(example), "sweep.executor=[sequential, processes]", "train.rounds=2"]
    with contextlib.redirect_stdout(io.StringIO()):
        out["run_status"] = cli.main([*run, f"output_dir={work / 'runs'}", "device=cpu", "--quiet"])

    # hetfl list --plugin: the example (a path relative to the current directory) and a
    # plugin nothing else imports, with a partitioner and a client-program wrapper
    (work / "extra.py").write_text(
        "from hetfl.api import register_wrapper\n"
        "from hetfl.data import PARTITIONERS\n"
        "PARTITIONERS.register('halves', print)\n"
        "register_wrapper('silent', summary='a client that sends nothing')(print)\n"
    )
    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):
        out["list_status"] = cli.main(
            [
                "list",
                "--plugin",
                "examples/plugin/fedavgm_plugin.py",
                "--plugin",
                str(work / "extra.py"),
            ]
        )
    out["list"] = listing.getvalue().splitlines()

    # the example's method is Hsu et al.'s server momentum
    out["fedavgm"] = fedavgm_steps(server_lr=0.7, momentum=0.5, rounds=3)

    # names taken twice: from HetFL, across the model registries, from another plugin
    plugins = {
        "dup_method.py": (
            "from hetfl.api import Options, register_algorithm\n"
            "register_algorithm('fedavg', Options, summary='mine')(print)\n"
        ),
        "dup_model.py": (
            "from hetfl.models import ARCHITECTURES\nARCHITECTURES.register('linear', None)\n"
        ),
        "dup_plugin.py": "from hetfl.models import MODELS\nMODELS.register('tiny-mlp', None)\n",
    }
    for name, source in plugins.items():
        (work / name).write_text(source)
        out[name] = refused({"plugins": [str(work / name)]})
    # another file of the example's name
    (work / "other").mkdir()
    (work / "other" / "fedavgm_plugin.py").write_text("")
    out["same_file_name"] = refused({"plugins": [str(work / "other" / "fedavgm_plugin.py")]})

    # a node: the server's config names the example by the server's path, which this
    # process never saw; the plugin of that file name is imported here, so it validates
    server = {
        "plugins": ["/on/the/server/fedavgm_plugin.py"],
        "algorithm": "fedavgm",
        "model": {"name": "tiny-mlp"},
        "data": {"dataset": "digits", "num_clients": 4},
        "train": {"clients_per_round": 2},
    }
    received = validate(server, import_plugins=False)
    out["node"] = [received.plugins, received.algorithm, received.model.name]
    out["sign_flip"] = sign_flip_upload()
    (work / "probe.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
