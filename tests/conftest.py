"""Shared fixtures: small real federations that train in well under a second per round.

The suite's numerics are pinned here, before torch is first imported: on x86-64 with AVX2
or better, ATen's and oneDNN's instruction sets are capped at AVX2
(`hetfl.engine.numerics.PINS`), the level the golden fixtures were written at, so that they
compare bit for bit on any such CPU. Set in `os.environ`, the pins reach every process the
tests start (worker processes, `hetfl run` subprocesses). `HETFL_UNPINNED=1` leaves the
machine's own numerics (the goldens then compare to their measured tolerance).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hetfl.engine.numerics import pins_for_this_machine

if "torch" in sys.modules:
    raise RuntimeError(
        "torch was imported before tests/conftest.py could pin the suite's numerics "
        "(a pytest plugin?): the golden fixtures cannot compare bit for bit"
    )
#: The pins this run set (empty where none apply, or with HETFL_UNPINNED=1).
SUITE_PINS = {} if os.environ.get("HETFL_UNPINNED") else pins_for_this_machine()
os.environ.update(SUITE_PINS)

import numpy as np  # noqa: E402 (after the pins)
import pytest  # noqa: E402 (after the pins)
import torch  # noqa: E402 (after the pins)

from hetfl.data import PARTITIONERS, build_clients, global_test, load_synthetic  # noqa: E402 (after the pins)
from hetfl.models import PlainFamily  # noqa: E402 (after the pins)

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


def fmnist_available() -> bool:
    return (FMNIST_DIR / "train-images-idx3-ubyte.gz").exists()


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def _setup_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("setup-queries")


@pytest.fixture(autouse=True)
def _setup_answers_kept_in_the_session(_setup_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs built by the runner keep their set-up answers (ZiCo scores) in a folder of the
    test session, not in the user's cache (an absolute name replaces the cache root's)."""
    monkeypatch.setattr("hetfl.runner.SETUP_CACHE", str(_setup_cache))


@pytest.fixture
def synthetic_federation():
    """8 IID clients of a learnable synthetic 10-class problem, an MLP family."""
    ds = load_synthetic(n_train=800, n_test=400, num_classes=10, shape=(1, 8, 8), seed=0)
    parts = PARTITIONERS.get("iid")(ds.y_train, 8, np.random.default_rng(0))
    clients = build_clients(ds, parts, test_per_client=20, seed=0)
    family = PlainFamily("mlp", ds.input_shape, ds.num_classes)
    return family, clients, global_test(ds, "cpu")


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- golden runs, shared by the whole pytest run ----------------------------------------------
class GoldenRuns:
    """Each golden scenario run once per pytest run with the sequential executor, on first
    request, and kept: `tests/test_golden.py` compares it with its fixture, and every test
    that computes the same run another way (worker processes, another engine, a resume)
    compares with it, on this machine, in this run, bit for bit, never with the fixture,
    which may have been written with other numerics. `modes` records how each fixture was
    compared, for the summary at the end of the run."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[str, dict] = {}
        self.modes: dict[str, str] = {}

    def __getitem__(self, name: str) -> dict:
        from golden.harness import BY_NAME, run_scenario

        if name not in self.runs:
            self.runs[name] = run_scenario(BY_NAME[name], self.root / name)
        return self.runs[name]


_GOLDEN: list[GoldenRuns] = []


@pytest.fixture(scope="session")
def golden_runs(tmp_path_factory: pytest.TempPathFactory) -> GoldenRuns:
    if not _GOLDEN:
        _GOLDEN.append(GoldenRuns(tmp_path_factory.mktemp("golden")))
    return _GOLDEN[0]


#: How each golden fixture was compared in the worker processes of a parallel run
#: (`make test`: pytest-xdist), gathered in the controlling process for its summary.
_WORKER_MODES: dict[str, str] = {}


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a pytest-xdist worker: hand the golden comparisons to the controlling process."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and _GOLDEN:
        workeroutput["golden_modes"] = dict(_GOLDEN[0].modes)


def pytest_testnodedown(node, error) -> None:  # a pytest-xdist hook, called in the controller
    _WORKER_MODES.update(getattr(node, "workeroutput", {}).get("golden_modes", {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say how the golden fixtures were compared: bit for bit with the suite's pins, or to
    their measured tolerance, and why."""
    modes = {**_WORKER_MODES, **(_GOLDEN[0].modes if _GOLDEN else {})}
    if not modes:
        return
    from golden.harness import describe_modes

    terminalreporter.write_sep("-", "golden fixtures")
    terminalreporter.write_line(describe_modes(modes, SUITE_PINS))


@pytest.fixture
def plugins_unloaded():
    """A config that names a plugin file loads it into this process: its registrations (the
    sign-flip attack of examples/plugin) would then be in every later test's registries.
    After the test, every registry gets back its entries and the plugin files' modules
    leave `sys.modules` (a later config naming one imports and registers it again)."""
    import gc
    import sys
    import warnings

    from hetfl.core.plugins import FILE_MODULE_PREFIX
    from hetfl.core.registry import Registry

    with warnings.catch_warnings():  # isinstance on torch's deprecated module attributes
        warnings.simplefilter("ignore")
        registries = [o for o in gc.get_objects() if isinstance(o, Registry)]
    saved = [(r, dict(r._entries)) for r in registries]
    yield
    for registry, entries in saved:
        registry._entries.clear()
        registry._entries.update(entries)
    for name in [n for n in sys.modules if n.startswith(FILE_MODULE_PREFIX)]:
        del sys.modules[name]
