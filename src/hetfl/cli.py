"""One job: the `hetfl` command line (run, resume, list, compare, plot, serve, client) and its
exit statuses.

User errors (a bad config, a missing dataset, an impossible partition, malformed data) end
with a message and exit status 2, without a traceback; set HETFL_DEBUG=1 to see one. A run
that reaches its end without aggregating any client's result in any round (every client
failed every round) exits with status 3, and so does a sweep in which any point did; Ctrl-C
exits with 130.

`hetfl --help` and `hetfl list` import neither torch, Flower nor matplotlib (start-up in a
fraction of a second): this module imports the config, the engines and the report only
inside the commands that use them, and `list` reads `hetfl.catalogue`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hetfl.engine.outputs import (
    NOTHING_AGGREGATED_EXIT,
    TARGET_METRICS,
    Target,
    nothing_aggregated,
)

if TYPE_CHECKING:
    from hetfl.config import RunConfig

EXIT_STATUSES = f"""exit status (run, resume, serve):
  0    every run aggregated clients' results in at least one round
  2    invalid configuration or data (the message names the field or file)
  {NOTHING_AGGREGATED_EXIT}    a run aggregated no client's result in any round (every client
       failed every round; summary.json counts the failures by kind); a sweep
       exits {NOTHING_AGGREGATED_EXIT} if any of its points did, after running them all
  130  interrupted (Ctrl-C); `hetfl resume RUN_DIR` continues"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hetfl",
        description="HetFL: federated learning across heterogeneous clients, simulated on one\n"
        "machine or deployed over Flower. `hetfl COMMAND --help` tells more; docs/usage.md\n"
        "is the guide.",
        epilog=EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="run a config (a sweep runs every point)",
        epilog=EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("config", nargs="?", help="YAML config (default: the built-in demo job)")
    run.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.lr=0.1")
    run.add_argument("--overwrite", action="store_true", help="replace existing run folders")
    run.add_argument("--quiet", action="store_true", help="no progress display")
    _plugin_option(run)

    resume = sub.add_parser(
        "resume",
        help="continue a run (or every point of a sweep) from its last checkpoint",
        epilog=EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    resume.add_argument("run_dir", type=Path, help="a run folder, or a sweep's folder")
    resume.add_argument(
        "overrides",
        nargs="*",
        help="key=value for keys that cannot alter results only (executor, workers, ray.*, "
        "checkpoint_every, tracking, ...: docs/usage.md); recorded in summary.json",
    )
    resume.add_argument("--quiet", action="store_true", help="no progress display")

    listing = sub.add_parser(
        "list", help="registered algorithms, models, datasets, partitioners, reducers, wrappers"
    )
    _plugin_option(listing)

    part = sub.add_parser("partition", help="print and save the per-client class counts")
    part.add_argument("config", nargs="?", help="YAML config (default: the built-in demo job)")
    part.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    _plugin_option(part)

    data = sub.add_parser("data", help="dataset tools")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    download = data_sub.add_parser(
        "download", help="fetch a dataset into the cache and verify its checksums"
    )
    download.add_argument("dataset", help="dataset name, e.g. cifar10 (a wrong one lists all)")
    download.add_argument("--dest", type=Path, help="directory (default: the HetFL cache)")
    download.add_argument("--mirror", help="base URL of a mirror (default: upstream)")

    compare = sub.add_parser("compare", help="table of runs: mean ± sd over seeds")
    compare.add_argument("runs", nargs="+", type=Path, help="run directories or sweep folders")
    compare.add_argument(
        "--select",
        choices=["val_acc"],
        help="per algorithm, only the swept setting of highest mean best val_acc over seeds",
    )
    compare.add_argument(
        "--paired",
        nargs=2,
        metavar=("A", "B"),
        help="per setting, metric and sub-model, A - B over the seeds both ran, its 95%% "
        "interval, the effect the seeds could detect and the verdict on the claim (--claim; "
        "holds / non-inferior / tie / fails, inconclusive under 3 seeds; docs/results.md)",
    )
    compare.add_argument(
        "--claim",
        choices=["superiority", "non-inferiority"],
        default="superiority",
        help="with --paired: 'A is better than B' by more than --margin (default), or 'A is "
        "no worse than B' by more than --margin",
    )
    compare.add_argument(
        "--margin",
        type=float,
        default=0.0,
        metavar="POINTS",
        help="with --paired: the claim's margin in accuracy points (default 0; a "
        "non-inferiority claim needs one > 0, declared before the runs)",
    )
    compare.add_argument(
        "--pilot-sd",
        type=float,
        metavar="POINTS",
        help="with --paired: the seed-to-seed spread of the differences a pilot measured, "
        "for the detectable effect (default: the observed spread, labelled so)",
    )
    compare.add_argument(
        "--target",
        action="append",
        type=target_arg,
        metavar="METRIC=VALUE",
        help="time to this level, found in each run's metrics.jsonl instead of the targets "
        "its config named (repeatable; e.g. val_acc=0.8)",
    )

    study = sub.add_parser(
        "study",
        help="run, track or report a study declared before its runs (studies/*.yaml)",
        description="A study file declares the claim, methods, evaluation protocol, primary "
        "metric, seeds and budget; `run` runs its points resumably and keeps their records "
        "in results/<study>/, `status` says what is done, `report` writes "
        "results/<study>/report.md from the records alone (docs/studies.md).",
    )
    study.add_argument("action", choices=["run", "status", "report"])
    study.add_argument("file", type=Path, help="the study file, e.g. studies/x.yaml")
    study.add_argument(
        "--runs", type=Path, default=Path("runs/studies"), help="where the run folders go"
    )
    study.add_argument(
        "--results",
        type=Path,
        default=Path("results"),
        help="where the records the repository keeps go (default: results/)",
    )
    study.add_argument(
        "--seed",
        type=int,
        action="append",
        dest="seeds",
        metavar="SEED",
        help="`run` only this seed's points (repeatable): one study's seeds in several "
        "processes or machines at once, into the same records folder",
    )
    study.add_argument("--quiet", action="store_true", help="no progress display")

    plot = sub.add_parser("plot", help="accuracy curves of several runs in one PNG")
    plot.add_argument(
        "runs", nargs="+", type=Path, help="run directories or sweep folders (seeds as a band)"
    )
    plot.add_argument(
        "-o",
        "--out",
        type=Path,
        default=Path("comparison.png"),
        help="the PNG to write (default: comparison.png in the current folder)",
    )
    plot.add_argument(
        "--x",
        choices=["round", "bytes", "sim_time"],
        default="round",
        help="the x axis: round, MB sent (bytes) or simulated time (sim_time, with device "
        "profiles); default round",
    )

    serve = sub.add_parser("serve", help="serve a config as a Flower federation (docs/deploy.md)")
    serve.add_argument("config", help="YAML config")
    serve.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    serve.add_argument("--insecure", action="store_true", help="no TLS (trusted networks only)")
    serve.add_argument("--ssl-ca-certfile", type=Path, help="CA certificate (PEM)")
    serve.add_argument("--ssl-certfile", type=Path, help="SuperLink certificate (PEM)")
    serve.add_argument("--ssl-keyfile", type=Path, help="SuperLink private key (PEM)")
    serve.add_argument(
        "--node-public-key",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="a client node's public key; repeat per node; turns node authentication on",
    )
    serve.add_argument("--bind", help="listen address (default: deploy.superlink's host)")
    serve.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    serve.add_argument("--overwrite", action="store_true", help="replace an existing run folder")
    _plugin_option(serve)

    client = sub.add_parser("client", help="start a client node on one data partition")
    client.add_argument("--partition-id", type=int, required=True, help="client id, 0-based")
    client.add_argument("--config", type=Path, required=True, help="YAML config (its data)")
    client.add_argument("--superlink", help="host:port (default: the config's deploy.superlink)")
    client.add_argument("--insecure", action="store_true", help="no TLS (trusted networks only)")
    client.add_argument("--root-certificates", type=Path, help="CA certificate (PEM)")
    client.add_argument("--auth-key", type=Path, help="this node's private key (node auth)")
    client.add_argument("--state-dir", type=Path, help="keep private state here across restarts")
    client.add_argument(
        "--attr", action="append", default=[], metavar="KEY=VALUE", help="declared attribute"
    )
    return p


def _plugin_option(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--plugin",
        action="append",
        default=[],
        dest="plugins",
        metavar="MODULE",
        help="import a module (my_package.my_module) or a .py file first, for what it "
        "registers; repeatable; added to the config's plugins (docs/plugins.md)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow flags (`hetfl run cfg.yaml --quiet train.lr=0.1`);
    # argparse cannot intermix positionals with subcommands, so collect them here.
    takes_overrides = args.command in ("run", "resume", "partition", "serve")
    stray = [a for a in extra if not takes_overrides or "=" not in a or a.startswith("-")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if argv is None and args.command in TRAINING_COMMANDS:
        _reexec_with_heap_tunables()
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        print(
            "interrupted; `hetfl resume RUN_DIR` continues from the last checkpoint",
            file=sys.stderr,
        )
        return 130
    except BrokenPipeError:
        # The reader went away (`hetfl study status ... | head`): not an error of the run.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except _user_errors() as exc:
        if os.environ.get("HETFL_DEBUG"):
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {message}", file=sys.stderr)
        return 2


#: The commands that train or evaluate, which run under `engine.heap.HEAP_TUNABLES`.
TRAINING_COMMANDS = ("run", "resume", "serve", "client")


def _reexec_with_heap_tunables() -> None:
    """Replace this process (same pid, same arguments) with one whose glibc keeps large
    blocks in the heap: about half the CPU of evaluation-heavy runs (`engine/heap.py`).
    Only from the command line itself (`main()` with no argv), so that an embedding
    program's process is never replaced; nothing where the C library is not glibc or
    GLIBC_TUNABLES is already set."""
    from hetfl.engine.heap import c_library, tuned_environment

    env = tuned_environment(os.environ, c_library())
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _user_errors() -> tuple[type[Exception], ...]:
    """The errors that end with a message and exit status 2. A function, not a constant,
    because `DownloadError` lives in `hetfl.data`, which imports torch: an `except` clause
    evaluates it only when an exception reaches it."""
    from hetfl.config import ConfigError
    from hetfl.data.fetch import DownloadError

    return (ConfigError, FileNotFoundError, ValueError, KeyError, DownloadError)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        return cmd_run(args.config, args.overrides, args.overwrite, args.quiet, args.plugins)
    if args.command == "resume":
        return cmd_resume(args.run_dir, args.quiet, args.overrides)
    if args.command == "list":
        return cmd_list(args.plugins)
    if args.command == "data":
        return cmd_download(args.dataset, args.dest, args.mirror)
    if args.command == "partition":
        return cmd_partition(args.config, args.overrides, args.plugins)
    if args.command == "compare":
        rule = (args.claim, args.margin, args.pilot_sd)
        return cmd_compare(args.runs, args.select, args.paired, args.target, rule)
    if args.command == "plot":
        return cmd_plot(args.runs, args.out, args.x)
    if args.command == "study":
        return cmd_study(args.action, args.file, args.runs, args.results, args.quiet, args.seeds)
    if args.command == "serve":
        from hetfl.launch import serve_config

        raw = _raw_config(args.config, args.overrides, args.plugins)
        return serve_config(raw, args)
    if args.command == "client":
        from hetfl.launch import start_client

        return start_client(args)
    raise AssertionError(args.command)


def _raw_config(config: str | None, overrides: Sequence[str], plugins: Sequence[str] = ()) -> dict:
    """The config as loaded (the built-in default when none is named), overrides applied,
    `--plugin`s added to its plugins (validation imports them)."""
    from hetfl.config import default_config_path, load_raw, parse_overrides, set_dotted

    if config is not None and "=" in config and not Path(config).exists():
        overrides, config = [config, *overrides], None
    raw = load_raw(config if config is not None else default_config_path())
    for key, value in parse_overrides(overrides).items():
        set_dotted(raw, key, value)
    named = raw.get("plugins") or []
    if plugins and isinstance(named, list):  # anything else: validation says what is wrong
        raw["plugins"] = [*named, *plugins]
    return raw


def cmd_run(
    config: str | None,
    overrides: Sequence[str],
    overwrite: bool,
    quiet: bool,
    plugins: Sequence[str] = (),
) -> int:
    from hetfl.config import ConfigError, validate_points
    from hetfl.config.output import writable_folder
    from hetfl.runner import run_one

    raw = _raw_config(config, overrides, plugins)
    points = validate_points(raw)
    first = points[0][1]
    base = Path(first.output_dir) / first.name
    writable_folder(base)
    is_sweep = bool(raw.get("sweep"))
    dirs = [base / name if is_sweep else base for name, _ in points]
    if not overwrite:
        taken = [d for d in dirs if (d / "metrics.jsonl").exists() or (d / "summary.json").exists()]
        if taken:
            raise ConfigError(
                f"{taken[0]} already holds a run; use `hetfl resume {taken[0]}` to continue it, "
                "--overwrite to replace it, or another name (name=...)"
            )
    for i, ((name, cfg), run_dir) in enumerate(zip(points, dirs, strict=True)):
        label = f"[{i + 1}/{len(points)} {name}] " if is_sweep else ""
        summary = run_one(cfg, run_dir, show_progress=not quiet, label=label, executor="auto")
        if not is_sweep:
            _print_summary(summary, run_dir)
    if is_sweep:
        _print_comparison(base, dirs)
    return _exit_status(dirs)


def _exit_status(run_dirs: Sequence[Path]) -> int:
    """0, or `NOTHING_AGGREGATED_EXIT` when any of the runs aggregated no client's result
    in any round; each such run is named on stderr."""
    status = 0
    for run_dir in run_dirs:
        path = run_dir / "summary.json"
        why = nothing_aggregated(json.loads(path.read_text())) if path.exists() else None
        if why is not None:
            print(f"error: {run_dir}: {why}", file=sys.stderr)
            status = NOTHING_AGGREGATED_EXIT
    return status


def _print_summary(summary: dict, run_dir: Path) -> None:
    final = summary.get("final", {})
    parts = [f"{k} {final[k]:.4f}" for k in ("global_acc", "local_acc") if final.get(k) is not None]
    print(f"{run_dir}: round {summary.get('rounds_completed')}  " + "  ".join(parts))


def _print_comparison(base: Path, dirs: Sequence[Path]) -> None:
    from hetfl.report import find_runs, write_comparison

    table = write_comparison(base, find_runs(list(dirs)))
    print(table)
    print(f"(written to {base / 'comparison.md'})")


def cmd_resume(run_dir: Path, quiet: bool, overrides: Sequence[str] = ()) -> int:
    """Continue a run, or every unfinished point of a sweep, after checking each folder's
    config against the one its checkpoint was written under (`hetfl.config.resume`);
    `overrides` may set only the keys that cannot alter results."""
    from hetfl.config import ConfigError
    from hetfl.runner import run_one

    if (run_dir / "deploy.json").exists():
        raise ConfigError(
            f"{run_dir} is a Flower run; continue it with "
            f"`hetfl serve {run_dir / 'config.yaml'} --resume` (see docs/deploy.md)"
        )
    if (run_dir / "config.yaml").exists():
        cfg, resumed = _resume_config(run_dir, overrides)
        summary = run_one(
            cfg, run_dir, resume=True, show_progress=not quiet, executor="auto", resumed=resumed
        )
        _print_summary(summary, run_dir)
        return _exit_status([run_dir])
    points = (
        sorted(d for d in run_dir.iterdir() if (d / "config.yaml").exists())
        if run_dir.is_dir()
        else []
    )
    if not points:
        raise FileNotFoundError(f"{run_dir} holds no run (no config.yaml) and no sweep points")
    checked = [(d, *_resume_config(d, overrides)) for d in points]  # all, before any runs
    for d, cfg, resumed in checked:
        if _finished(d, cfg):
            continue
        run_one(
            cfg,
            d,
            resume=True,
            show_progress=not quiet,
            label=f"[{d.name}] ",
            executor="auto",
            resumed=resumed,
        )
    _print_comparison(run_dir, points)
    return _exit_status(points)


def _resume_config(run_dir: Path, overrides: Sequence[str]) -> tuple[RunConfig, dict | None]:
    """The config to resume `run_dir` with: its config.yaml with `overrides` (result-neutral
    keys only), refused where it differs from the config the checkpoint was written under in
    what determines the results; and `summary.json`'s record of the resume (None when
    there is no checkpoint: the run starts again from round 1)."""
    from hetfl.config import load_raw, parse_overrides, set_dotted, validate
    from hetfl.config.resume import check_resume, neutral_overrides, resume_record
    from hetfl.engine.checkpoint import has_checkpoint, written_under

    given = parse_overrides(overrides)
    neutral_overrides(given)
    raw = load_raw(run_dir / "config.yaml")
    for key, value in given.items():
        set_dotted(raw, key, value)
    cfg = validate(raw)
    if not has_checkpoint(run_dir / "checkpoints"):
        return cfg, None
    after, written = written_under(run_dir / "checkpoints")
    edited = check_resume(written, cfg.to_yaml(), str(run_dir)) if written else []
    return cfg, resume_record(after, given, edited)


def _finished(run_dir: Path, cfg: RunConfig) -> bool:
    path = run_dir / "summary.json"
    return (
        path.exists() and json.loads(path.read_text()).get("rounds_completed") == cfg.train.rounds
    )


def cmd_study(
    action: str,
    file: Path,
    runs: Path,
    results: Path,
    quiet: bool,
    seeds: Sequence[int] | None = None,
) -> int:
    """`run` (then the report), `status` or `report`; `run` exits 1 while points remain
    (the budget spent)."""
    from hetfl.study import open_study, run_study, status_lines, write_report

    study = open_study(file, runs, results)
    if action == "status":
        print("\n".join(status_lines(study)))
        return 0
    pending = run_study(study, show_progress=not quiet, seeds=seeds) if action == "run" else 0
    path = write_report(study)
    print(path.read_text(), end="")
    print(f"(written to {path})")
    return 1 if pending else 0


def cmd_list(plugins: Sequence[str] = ()) -> int:
    """The registries' names and summaries: HetFL's own from the torch-free catalogue
    (which the tests hold equal to the registries), or, with `plugins`, every entry once
    they are imported, and what each registered."""
    from hetfl.listing import built_in, lines, with_plugins

    print("\n".join(lines(with_plugins(plugins) if plugins else built_in())))
    return 0


def cmd_partition(config: str | None, overrides: Sequence[str], plugins: Sequence[str] = ()) -> int:
    """The class counts of every client, as the run with this config would partition them
    (the first sweep point's seed, when the config is a sweep)."""
    from hetfl.assembly import load_dataset, partition
    from hetfl.config import expand_sweep, validate
    from hetfl.config.output import writable_folder
    from hetfl.data import class_counts, format_class_table

    raw = _raw_config(config, overrides, plugins)
    cfg = validate(next(iter(expand_sweep(raw)))[1])
    writable_folder(Path(cfg.output_dir) / cfg.name)
    dataset = load_dataset(cfg)
    parts = partition(cfg, dataset)
    table = format_class_table(class_counts(dataset.y_train, parts, dataset.num_classes))
    sizes = [len(p) for p in parts]
    head = (
        f"{cfg.data.dataset}, {cfg.data.partition.kind} partition over {len(parts)} clients, "
        f"seed {cfg.seed}: {min(sizes)}-{max(sizes)} samples per client"
    )
    out_dir = Path(cfg.output_dir) / cfg.name
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "partition.txt").write_text(f"{head}\n{table}\n")
    print(f"{head}\n{table}\n(written to {out_dir / 'partition.txt'})")
    return 0


def cmd_download(dataset: str, dest: Path | None, mirror: str | None) -> int:
    from hetfl.data.download import BY_HAND, DOWNLOADERS
    from hetfl.data.leaf import LEAF_DATASETS, generation_message

    if dataset in LEAF_DATASETS:
        raise ValueError(generation_message(dataset))
    if dataset in BY_HAND:
        raise ValueError(f"HetFL does not download {dataset}; get it by {BY_HAND[dataset]}")
    if dataset not in DOWNLOADERS:
        raise ValueError(
            f"no download for dataset {dataset!r}; available: {', '.join(DOWNLOADERS)}"
        )
    shown: dict[str, int] = {}

    def progress(name: str, received: int, total: int | None) -> None:
        step = received >> 22  # a line every 4 MiB, and at the end
        if shown.get(name) != step or received == total:
            shown[name] = step
            size = f"/{total / 1e6:.1f}" if total else ""
            print(f"  {name}: {received / 1e6:.1f}{size} MB", file=sys.stderr, flush=True)

    where = DOWNLOADERS[dataset](dest, mirror, progress=progress)
    print(f"{dataset}: verified files in {where}")
    return 0


def target_arg(text: str) -> Target:
    """`METRIC=VALUE` of `hetfl compare --target`, checked here so a typo is an argparse
    error naming the allowed metrics."""
    metric, sep, value = text.partition("=")
    if not sep or metric not in TARGET_METRICS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected METRIC=VALUE with METRIC one of {', '.join(TARGET_METRICS)} "
            "(e.g. val_acc=0.8)"
        )
    try:
        return Target(metric, float(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number") from None


def cmd_compare(
    paths: Sequence[Path],
    select: str | None = None,
    paired: Sequence[str] | None = None,
    targets: Sequence[Target] | None = None,
    rule: tuple[str, float, float | None] = ("superiority", 0.0, None),
) -> int:
    """The comparison table; with `select` ("val_acc"), one swept setting per algorithm,
    chosen by validation accuracy, and a line per algorithm saying which; with `paired`
    (A, B), the paired differences A - B and their verdicts on the claim `rule` (shape,
    margin and pilot spread in accuracy points; `hetfl.paired`); with `targets`, the time
    to those levels instead of the runs' own."""
    from hetfl.paired import Rule, paired_differences, paired_rows
    from hetfl.report import comparison_rows, find_runs, format_table, selection_rows

    shape, margin, pilot_sd = rule
    if paired is None and (shape, margin, pilot_sd) != ("superiority", 0.0, None):
        raise ValueError("--claim, --margin and --pilot-sd judge a --paired comparison: give it")
    runs = find_runs(paths)
    if paired is not None:
        if select is not None:
            raise ValueError(
                "--paired compares every setting both methods ran; --select picks one per "
                "method: give one of them"
            )
        claim = Rule.in_points(shape, margin, pilot_sd)
        a, b = paired
        differences = paired_differences(runs, a, b, claim, targets or ())
        if not differences:
            raise ValueError(
                f"--paired {a} {b}: no setting and seed that both ran (each needs a run of the "
                "other with the same point name after its own and the same seed)"
            )
        print(
            f"A = {a}, B = {b}: A - B over shared seeds; claim: {claim.describe()}; verdicts "
            "from the 95% t interval, none under 3 seeds"
        )
        print(format_table(paired_rows(differences)))
        return 0
    if select is None:
        print(format_table(comparison_rows(runs, targets)))
        return 0
    rows, selections = selection_rows(runs, targets)
    print("selected by mean over seeds of each run's best val_acc:")
    for s in selections:
        print(
            f"  {s.algorithm}: {s.setting} (val_acc {s.val_acc:.4f} ± {s.val_acc_sd:.4f}; "
            f"seeds {s.seeds}, settings compared {s.candidates})"
        )
    print(format_table(rows))
    return 0


def cmd_plot(paths: Sequence[Path], out: Path, x: str) -> int:
    from hetfl.report import find_runs, plot_runs

    written = plot_runs(find_runs(paths), out, x=x)
    print(f"(written to {written.resolve()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
