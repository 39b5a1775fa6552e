"""The Ray executor: results equal the sequential executor's bit for bit on two Ray nodes of
one machine, a dead actor fails only its clients, a resume under another executor gives
the same metrics, and a run stopped by Ctrl-C leaves no process behind.

The tests that run units share one local Ray cluster of two nodes of one CPU each
(`cluster`, `ray.cluster_utils.Cluster`) and one executor on it (`on_ray`: an actor on
each node); they are marked `ray` (`-m "not ray"` skips them) and skip where Ray is not
installed. The config and factory checks need no Ray."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from golden.harness import BY_NAME, assert_same_as_sequential, run_scenario
from hetfl.config import validate
from hetfl.core.types import Problem
from hetfl.engine.heap import _malloc_trim
from hetfl.engine.numerics import NUMERIC_ENV
from hetfl.engine.ports import free_port
from hetfl.engine.watchdog import writers
from hetfl.runner import build_simulation
from hetfl.sim.factory import make_executor
from hetfl.sim.ray_executor import MISSING, WORKER_NICENESS, RayExecutor, RaySettings
from hetfl.sim.ray_session import join
from test_executor_processes import (
    KillsItsWorker,
    _config,
    _fragment_heap,
    _Raises,
    _resident_bytes,
)
from test_setup_queries import _scores, _simulation

TESTS = Path(__file__).parent
SRC = TESTS.parent / "src"

#: Golden scenarios that must also hold on two Ray nodes (a subset of the process
#: executor's `UNDER_PROCESSES`): plain training, widths with an evaluation per width,
#: a client that raises, a stats pass, and split learning (a client and its server session
#: in one actor).
UNDER_RAY = ["fedavg", "heterofl-dynamic", "fedavg-failing-client", "fedbn", "splitfed"]


@pytest.fixture(scope="module")
def cluster():
    """One local Ray of two nodes (one CPU each) for the module; its workers find HetFL
    and the tests' helpers on their PYTHONPATH, and the suite's numeric pins in their
    environment (`tests/conftest.py` sets them in `os.environ`)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SRC), str(TESTS), *filter(None, [before])])
    niceness = {"worker_niceness": WORKER_NICENESS}
    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "_system_config": niceness},
    )
    nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    ray.init(address=nodes.address)
    try:
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()
        if before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = before


@pytest.fixture(scope="module")
def on_ray(cluster):
    with RayExecutor(RaySettings(cluster.address)) as executor:
        yield executor


@pytest.mark.ray
def test_the_units_take_one_actor_on_each_node(on_ray):
    import ray

    assert on_ray.units == 2
    nodes = {ray.get(actor.node.remote()) for actor in on_ray._actors}
    assert len(nodes) == 2
    assert "2 units x 1 thread(s), 1.0 CPU each" in on_ray.describe()
    # the suite's numeric pins travel in the actors' runtime_env (to any node of a cluster),
    # each with its value, beside whatever else the machine sets (OPENBLAS_CORETYPE, say);
    # imported here: an actor imports this module, and conftest refuses a late import
    from conftest import SUITE_PINS

    programs = build_simulation(validate(_config()), Path("unused"), show_progress=False).programs
    seen = on_ray.map(programs, _environment, [0, 1])
    assert [threads for _, threads in seen] == [1, 1]
    for env_vars, _ in seen:
        assert {k: env_vars.get(k) for k in SUITE_PINS} == SUITE_PINS


def _environment(ctx, item: int) -> tuple[dict[str, str], int]:
    import ray

    env_vars = ray.get_runtime_context().runtime_env.get("env_vars", {})
    return {k: v for k, v in env_vars.items() if k in NUMERIC_ENV}, torch.get_num_threads()


@pytest.mark.ray
@pytest.mark.parametrize("name", UNDER_RAY)
def test_golden_scenario_on_two_ray_nodes_is_bit_for_bit(name, on_ray, tmp_path, golden_runs):
    """Compared with the sequential executor's run of the scenario in this pytest run."""
    got = run_scenario(BY_NAME[name], tmp_path, on_ray)
    assert_same_as_sequential(golden_runs[name], got, "on two Ray nodes")


class _Recording:
    """An executor that keeps the outcomes of the one it wraps."""

    def __init__(self, executor: RayExecutor) -> None:
        self.executor, self.outcomes = executor, []

    def run(self, *args):
        done = self.executor.run(*args)
        self.outcomes += done
        return done

    def __getattr__(self, name: str):
        return getattr(self.executor, name)


@pytest.mark.ray
def test_zico_answers_on_two_ray_nodes_equal_the_sequential_ones_bit_for_bit(
    on_ray, synthetic_federation, tmp_path
):
    """FedFA's set-up query as units of the actors: every client's ZiCo scores equal
    those asked in process exactly."""
    sequential = _simulation(synthetic_federation, tmp_path / "seq")
    sequential.setup()
    parallel = _simulation(synthetic_federation, tmp_path / "ray", executor=on_ray)
    parallel.setup()
    assert _scores(parallel) == _scores(sequential) and len(_scores(parallel)) == 8


@pytest.mark.ray
def test_an_actor_killed_mid_round_fails_only_its_client_and_is_replaced(on_ray, tmp_path):
    one_round = validate({**_config(), "train": {**_config()["train"], "rounds": 1}})
    sim = build_simulation(one_round, tmp_path, show_progress=False)
    sim.programs.wrappers = (KillsItsWorker(3),)
    sim.executor = _Recording(on_ray)
    restarts = on_ray.restarts
    sim.run()
    (died,) = [o.output for o in sim.executor.outcomes if isinstance(o.output, Problem)]
    assert died.kind == "raised" and died.detail.startswith("client 3 failed: its Ray actor died")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["clients"] for r in rows] == [5]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failures"] == {"raised": 1}
    assert on_ray.restarts == restarts + 1
    assert 3 not in sim.store and all(c in sim.store for c in (0, 1, 2, 4, 5))
    # the others trained as they do when client 3 raises in process
    ref = build_simulation(one_round, tmp_path / "ref", show_progress=False)
    ref.programs.wrappers = (_Raises(3),)
    ref.run()
    for cid in (0, 1, 2, 4, 5):
        for k, v in ref.store.get(cid).items():
            assert torch.equal(v, sim.store.get(cid)[k])
    for k, v in ref.state.items():
        assert torch.equal(v, sim.state[k])


def _fails(ctx, item: int) -> int:
    if item == 2:
        raise ValueError("unit 2 is broken")
    return item * 10


@pytest.mark.ray
def test_a_unit_that_raises_stops_the_exchange_with_its_traceback(on_ray):
    programs = build_simulation(validate(_config()), Path("unused"), show_progress=False).programs
    actors = list(on_ray._actors)
    with pytest.raises(RuntimeError, match=r"(?s)failed in a Ray actor.*unit 2 is broken"):
        on_ray.map(programs, _fails, [0, 1, 2, 3])
    assert on_ray.map(programs, _fails, [3, 1, 0], costs=[0, 5, 1]) == [30, 10, 0]
    assert on_ray._actors == actors  # the same actors go on


def _metrics(run_dir: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k != "wall_time_s"}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def _fragmented_in(ctx, item: int) -> tuple[int, int]:
    return os.getpid(), _fragment_heap(ctx, item)


def _resident_in(ctx, item: int) -> tuple[int, int]:
    return os.getpid(), _resident_bytes(ctx, item)


@pytest.mark.ray
@pytest.mark.skipif(_malloc_trim() is None, reason="the C library has no malloc_trim")
def test_an_actor_hands_its_freed_heap_back_when_the_next_exchange_arrives(on_ray):
    """As the process executor's workers do (`test_executor_processes`): each actor that
    left 160 MiB of freed heap in one exchange holds it no more at the next."""
    programs = build_simulation(validate(_config()), Path("unused"), show_progress=False).programs
    fragmented = dict(on_ray.map(programs, _fragmented_in, [0, 1]))
    after = dict(on_ray.map(programs, _resident_in, [0, 1]))
    both = fragmented.keys() & after.keys()
    assert both and all(after[pid] < fragmented[pid] - (100 << 20) for pid in both)


@pytest.mark.ray
def test_resume_under_another_executor_equals_an_uninterrupted_run(on_ray, tmp_path):
    """Rounds 1-2 on Ray, 3 resumed in process: the metrics and state of a sequential run."""
    whole = build_simulation(validate(_config()), tmp_path / "whole", show_progress=False)
    whole.run()
    first = validate({**_config(), "train": {**_config()["train"], "rounds": 1}})
    part = build_simulation(first, tmp_path / "part", show_progress=False)
    part.executor = on_ray
    part.run()
    rest = build_simulation(validate(_config()), tmp_path / "part", show_progress=False)
    rest.run(resume=True)
    assert _metrics(tmp_path / "whole") == _metrics(tmp_path / "part")
    for k, v in whole.state.items():
        assert torch.equal(v, rest.state[k])


# -- Ctrl-C ------------------------------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    """Each process's children (read from /proc)."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_run(tmp_path: Path) -> subprocess.Popen[bytes]:
    """`hetfl run` of 50 rounds on a local Ray of its own (address null, whatever RAY_ADDRESS
    says), in a process group of its own, once it has trained a round."""
    raw = _config(executor="ray", workers=1, output_dir=str(tmp_path), name="local")
    raw["train"]["rounds"] = 50
    (tmp_path / "c.json").write_text(json.dumps(raw))
    run = subprocess.Popen(
        [sys.executable, "-m", "hetfl.cli", "run", str(tmp_path / "c.json"), "--quiet"],
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stderr=subprocess.PIPE,
        env={**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONPATH": str(SRC)},
    )
    metrics = tmp_path / raw["name"] / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert run.poll() is None, run.stderr.read().decode() if run.stderr else ""
        time.sleep(0.1)
    return run


def _gone(pids: set[int] | list[int], within_s: float = 30.0) -> list[int]:
    """Those of `pids` still alive after up to `within_s` (a safety bound, not a limit the
    test measures)."""
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.ray
def test_ctrl_c_shuts_down_the_local_ray_the_run_started(tmp_path):
    """`hetfl run` on a local Ray of its own (address null), interrupted once it has
    trained a round: the run stops and every process it started (Ray's services, its
    actors, the watchdog) is gone. Ray's INFO line and its FutureWarning were not printed."""
    pytest.importorskip("ray")
    run = _start_run(tmp_path)
    started = _descendants(run.pid)
    assert len(started) >= 3  # Ray's services (GCS, raylet, ...) and the actor
    os.killpg(run.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole foreground group
    run.wait()
    assert run.returncode != 0
    said = run.stderr.read().decode() if run.stderr else ""
    assert "Started a local Ray instance" not in said and "FutureWarning" not in said, said
    assert _gone(started) == []


def _sessions(pids: set[int]) -> set[Path]:
    """The Ray session folders (`.../session_*`) that the processes `pids` write into."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = Path(os.readlink(fd))
                    found |= {p for p in target.parents if p.name.startswith("session_")}
    return found


@pytest.mark.ray
def test_a_driver_killed_alone_leaves_no_process_of_its_local_ray(tmp_path):
    """SIGKILL of the `hetfl run` process alone (as the out-of-memory killer ends it): the
    processes of its Ray session, listed by the process tree at the kill and by the
    session's folder they write into, end within seconds; Ray's agents would run on for a
    minute without the run's watchdog."""
    pytest.importorskip("ray")
    run = _start_run(tmp_path)
    tree = _descendants(run.pid)  # the watchdog, Ray's GCS, raylet, agents and the actor
    (session,) = _sessions(tree)
    ray_processes = set(writers([session], but={run.pid}))
    assert len(ray_processes) >= 5 and ray_processes < tree
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    assert _gone(tree) == []
    assert writers([session]) == []


# -- choosing it -------------------------------------------------------------------------------
def test_the_ray_section_is_validated_and_only_with_executor_ray():
    cfg = validate(_config(executor="ray", ray={"address": "10.0.0.1:6379", "cpus_per_unit": 2}))
    assert cfg.ray is not None
    assert cfg.ray.settings() == RaySettings("10.0.0.1:6379", 2.0, 0.0)
    assert validate(_config(executor="ray", ray={"address": "auto"})).ray is not None
    with pytest.raises(ValueError, match=r"a ray: section is for executor 'ray', but executor"):
        validate(_config(executor="processes", ray={"address": "auto"}))
    with pytest.raises(ValueError, match=r"a ray: section is for executor 'ray'"):
        validate(_config(ray={}))
    with pytest.raises(ValueError, match=r"ray.gpus: unknown key"):
        validate(_config(executor="ray", ray={"gpus": 1}))
    with pytest.raises(ValueError, match=r"String should match pattern"):
        validate(_config(executor="ray", ray={"address": "head node"}))
    with pytest.raises(ValueError, match=r"greater than 0"):
        validate(_config(executor="ray", ray={"cpus_per_unit": 0}))
    timeout = validate(_config(executor="ray", ray={"address": "auto", "connect_timeout_s": 2}))
    assert timeout.ray is not None and timeout.ray.settings().connect_timeout_s == 2.0
    with pytest.raises(ValueError, match=r"ray.connect_timeout_s: Input should be greater than 0"):
        validate(_config(executor="ray", ray={"connect_timeout_s": 0}))
    measured = {"preset": "dtfl", "clock": "measured"}
    with pytest.raises(ValueError, match=r"executor 'ray' with system.clock 'measured'"):
        validate(_config(executor="ray", system=measured))


def test_without_ray_installed_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'hetfl\[ray\]'") as caught:
        make_executor(
            "ray",
            workers=None,
            threads=1,
            device="cpu",
            deterministic=True,
            clients_per_round=4,
            measured_clock=False,
        )
    assert caught.value.args[0] == MISSING


def test_units_on_gpus_need_both_the_device_and_gpus_per_unit():
    with pytest.raises(ValueError, match=r"need both device 'cuda' and ray.gpus_per_unit > 0"):
        RayExecutor(RaySettings(gpus_per_unit=1), device="cpu")
    with pytest.raises(ValueError, match=r"need both device 'cuda' and ray.gpus_per_unit > 0"):
        RayExecutor(RaySettings(), device="cuda")


# -- a cluster that does not answer ------------------------------------------------------------
@pytest.mark.ray
def test_an_address_nothing_listens_on_is_one_error_line_and_no_run_folder(tmp_path):
    """`hetfl run ... ray.address=127.0.0.1:PORT` where nothing listens: exit 2 with one
    `error:` line naming the address and what to check, no traceback, no run folder."""
    pytest.importorskip("ray")
    address = f"127.0.0.1:{free_port()}"  # bound, then closed: nothing listens there
    raw = _config(executor="ray", output_dir=str(tmp_path), name="nowhere")
    raw["ray"] = {"address": address, "connect_timeout_s": 0.5}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    done = subprocess.run(
        [sys.executable, "-m", "hetfl.cli", "run", str(tmp_path / "c.json"), "--quiet"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        timeout=120,
    )
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: ray.address {address}: nothing accepted a connection")
    assert "within 0.5 s (ray.connect_timeout_s)" in lines[0] and "ray status" in lines[0]
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.ray
def test_auto_checks_the_address_ray_would_join(monkeypatch):
    """`auto` resolves as Ray does (RAY_ADDRESS first) and that address is what must answer;
    `ray.init` is never reached."""
    ray = pytest.importorskip("ray")
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail(f"ray.init({kw}) was called"))
    with pytest.raises(ValueError, match=rf"^ray\.address auto \(.*:{address.split(':')[1]}\): "):
        join(ray, "auto", 0.2)


def test_an_address_that_answers_but_is_no_ray_head_is_an_error_naming_it():
    """Something accepts connections there, and `ray.init` gives up (as Ray does after its
    retries, with ConnectionError): a ValueError naming the address, not a traceback."""

    def init(address: str, **_: object) -> None:
        raise ConnectionError(f"Failed to connect to Ray cluster at {address}")

    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"
        not_ray = types.SimpleNamespace(init=init, __version__="2.55.1")
        with pytest.raises(ValueError, match=rf"^ray\.address {address}: a connection is accepted"):
            join(not_ray, address, 5)
