"""The strategy's set-up query (FedFA's ZiCo scores) as units of the executor, kept on disk
across runs, and the run's phases timed and shown (issue 48, items 1 and 2)."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.parts import architecture_choice
from hetfl.core.client.program import Programs
from hetfl.core.training import LocalTraining
from hetfl.engine.phases import tree_cpu_s
from hetfl.engine.progress import Progress
from hetfl.engine.round_settings import RoundSettings
from hetfl.models import ScalableFamily
from hetfl.sim import ProcessExecutor, Simulation
from hetfl.sim.setup_queries import SetupQueryItem, answer_setup_query
from hetfl.sim.tasks import WorkerContext
from hetfl.systems.costs import MacCounter

FAMILY = ScalableFamily(
    {"family": "preresnet", "input_shape": (1, 8, 8), "num_classes": 10, "stages": 1}
)


def _simulation(
    federation, run_dir, *, widths=(0.25, 0.5), clients=None, limited_share=0.0, **kwargs
):
    """A FedFA run whose clients choose by ZiCo (by default no limited share: every client
    is asked)."""
    _, fed_clients, test = federation
    options = {
        "depths": [2, 3],
        "widths": list(widths),
        "choice": "zico",
        "limited_share": limited_share,
    }
    train = LocalTraining(steps=1, batch_size=8)
    strategy, recipe = ALGORITHMS.get("fedfa").build(
        FAMILY, options, clients_per_round=2, train=train, macs=MacCounter(FAMILY)
    )
    settings = RoundSettings(rounds=kwargs.pop("rounds", 1), seed=3, local_eval="sampled")
    return Simulation(
        strategy,
        Programs(FAMILY, recipe, seed=0),
        clients or fed_clients,
        test,
        settings,
        run_dir,
        **kwargs,
    )


def _scores(sim: Simulation) -> dict[int, dict[str, float]]:
    return {info.cid: info.attrs["zico"] for info in sim.known_clients()}


def _within_budgets(sim: Simulation) -> dict[int, set[str]]:
    """By hand, after set-up: each budgeted client's candidates within its budget."""
    choice = sim.strategy.assignment
    macs = {c.label: choice.macs(c) for c in choice.candidates}
    return {cid: {k for k, m in macs.items() if m <= b} for cid, b in choice.budget_of.items()}


def test_zico_answers_under_two_worker_processes_equal_the_sequential_ones_bit_for_bit(
    synthetic_federation, tmp_path
):
    """Every client's ZiCo scores, asked as units of two worker processes, equal those
    asked in process exactly (floats compared with ==), and so do the choices."""
    sequential = _simulation(synthetic_federation, tmp_path / "seq")
    sequential.setup()
    with ProcessExecutor(2) as pool:
        parallel = _simulation(synthetic_federation, tmp_path / "proc", executor=pool)
        parallel.setup()
    assert _scores(parallel) == _scores(sequential)
    assert len(_scores(sequential)) == 8
    assert parallel.strategy.describe() == sequential.strategy.describe()


def test_a_second_run_reads_the_kept_answers_and_changed_data_or_architectures_miss(
    synthetic_federation, tmp_path, monkeypatch
):
    """With a cache folder, the first run scores each client's candidates within its
    budget and keeps them (a file per client); a second run scores nothing and reads the
    same floats back; a client whose data changed, or candidates of another width, are
    scored again."""
    scored = []
    real = architecture_choice.zico

    def counting(model, batches):
        scored.append(1)
        return real(model, batches)

    monkeypatch.setattr(architecture_choice, "zico", counting)
    cache = tmp_path / "cache"
    first = _simulation(synthetic_federation, tmp_path / "a", setup_cache=cache)
    first.setup()
    assert {cid: set(labels) for cid, labels in _scores(first).items()} == _within_budgets(first)
    answered = sum(map(len, _scores(first).values()))
    assert len(scored) == answered and len(list(cache.glob("*.json"))) == 8
    again = _simulation(synthetic_federation, tmp_path / "b", setup_cache=cache)
    again.setup()
    assert len(scored) == answered, "a second run scored candidates again"
    assert _scores(again) == _scores(first)
    _, clients, _ = synthetic_federation
    changed = list(clients)
    x = changed[0].x_train.clone()
    x[0, 0, 0, 0] += 1.0
    changed[0] = replace(changed[0], x_train=x)
    _simulation(synthetic_federation, tmp_path / "c", clients=changed, setup_cache=cache).setup()
    answered += len(_scores(first)[0])
    assert len(scored) == answered, "only the changed client is scored again"
    wider = _simulation(
        synthetic_federation, tmp_path / "d", widths=(0.25, 0.75), setup_cache=cache
    )
    wider.setup()
    assert len(scored) == answered + sum(map(len, _scores(wider).values()))
    assert {cid: set(labels) for cid, labels in _scores(wider).items()} == _within_budgets(wider)
    assert "d2-w0.75" in set().union(*_scores(wider).values())


def test_only_the_clients_whose_scores_set_up_reads_are_asked(
    synthetic_federation, tmp_path, monkeypatch
):
    """With the default limited share, half the clients take the smallest candidate and are
    not scored, and each scored client scores only the candidates within its budget, by
    hand: every client's architecture is the one a run that asks every client of every
    candidate (told nothing) chooses."""
    scored = []
    real = architecture_choice.zico
    monkeypatch.setattr(architecture_choice, "zico", lambda m, b: scored.append(1) or real(m, b))
    runs = {}
    for name in ("every", "some"):
        sim = _simulation(synthetic_federation, tmp_path / name, limited_share=0.5)
        if name == "every":  # ask every client, as a run did before the selection
            every = {"setup_query_clients": lambda clients, _: {c.cid: {} for c in clients}}
            sim.strategy.capabilities = replace(sim.strategy.capabilities, **every)
        scored.clear()
        sim.setup()
        runs[name] = (sim.strategy.describe(), len(scored), sim)
    assert runs["every"][1] == 8 * 4
    within = _within_budgets(runs["some"][2])
    assert len(within) == 4 and all(len(labels) > 1 for labels in within.values())
    answers = {
        i.cid: set(i.attrs["zico"]) for i in runs["some"][2].known_clients() if "zico" in i.attrs
    }
    assert answers == within
    assert runs["some"][1] == sum(map(len, within.values())) < 4 * 4, "scored beyond budgets"
    assert runs["some"][0] == runs["every"][0]


def test_each_phase_is_shown_and_timed_in_the_summary(synthetic_federation, tmp_path):
    """The set-up query says how far it is; the summary's `phases` holds the set-up's
    phases and each round's training and evaluation, in wall and CPU seconds."""
    stream = io.StringIO()
    progress = Progress(2, stream=stream)
    sim = _simulation(synthetic_federation, tmp_path, rounds=2, progress=progress)
    summary = sim.run()
    text = stream.getvalue()
    assert "setup_query: asking 8 of 8 clients the strategy's set-up query" in text
    assert "setup_query: 8/8 clients" in text and "setup_query: done in" in text
    assert "train " in text.splitlines()[-1] and "eval " in text.splitlines()[-1]
    phases = summary["phases"]
    assert set(phases["setup"]) == {"setup_query", "setup"}
    assert set(phases["rounds"]) == {"1", "2"}
    assert set(phases["rounds"]["1"]) == {"train", "server_phase", "eval"}
    for timed in [*phases["setup"].values(), *phases["rounds"]["2"].values()]:
        assert set(timed) == {"wall_s", "cpu_s"} and timed["wall_s"] >= 0 <= timed["cpu_s"]
    # the set-up includes its query
    assert phases["setup"]["setup"]["wall_s"] >= phases["setup"]["setup_query"]["wall_s"]
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["phases"] == phases


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_cpu_time_of_a_live_child_process_is_counted():
    """A child that has spent 0.3 s of CPU and waits: the run's CPU time holds it."""
    spin = (
        "import sys, time\n"
        "while time.process_time() < 0.3: pass\n"
        "print('ready', flush=True); sys.stdin.readline()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert tree_cpu_s() - time.process_time() >= 0.25
    finally:
        child.communicate("\n")


def test_a_process_answers_every_client_with_the_first_copy_of_a_query_it_received(
    synthetic_federation, tmp_path, monkeypatch
):
    """Items arrive in a worker each with its own copy of the query (pickled): the process
    answers with the first copy under the same key, so each candidate is built once for all
    its clients, and the answers are those of a copy built afresh for each client."""
    built = []
    real = architecture_choice.build_model
    monkeypatch.setattr(
        architecture_choice, "build_model", lambda f, s: built.append(1) or real(f, s)
    )
    sim = _simulation(synthetic_federation, tmp_path)
    query = sim.strategy.capabilities.setup_query
    _, clients, _ = synthetic_federation
    items = [
        SetupQueryItem(
            pickle.loads(pickle.dumps(query)),
            c.info(),
            c,
            torch.Generator().manual_seed(c.cid),
            None,
            {},
        )
        for c in clients[:3]
    ]
    ctx = WorkerContext(sim.programs)
    answers = [answer_setup_query(ctx, item) for item in items]
    assert len(built) == 4, "each of the 4 candidates built once for the 3 clients"
    fresh = [
        pickle.loads(pickle.dumps(query))(i.info, i.data, torch.Generator().manual_seed(i.info.cid))
        for i in items
    ]
    assert answers == fresh
    assert ctx.setup_query(items[2].query) is items[0].query
    keyless = pickle.loads(pickle.dumps(query))
    keyless.key = None
    assert ctx.setup_query(keyless) is keyless


def test_a_client_told_its_budget_scores_only_the_candidates_within_it(
    synthetic_federation, tmp_path
):
    """Told a budget that fits three of the four candidates, a client scores those three,
    each to the float it has when every candidate is scored; a budget it declares itself
    wins; answers kept under two budgets are two files, each read back as it was."""
    sim = _simulation(synthetic_federation, tmp_path / "run")
    query = sim.strategy.capabilities.setup_query
    client = synthetic_federation[1][0]
    ctx = WorkerContext(sim.programs)
    costs = sorted(query.macs.values())
    assert len(set(costs)) == 4

    def answer(told, info=None, cache=None):
        item = SetupQueryItem(
            query, info or client.info(), client, torch.Generator().manual_seed(5), cache, told
        )
        return answer_setup_query(ctx, item)["zico"]

    every = answer({})
    assert len(every) == 4
    told = answer({"macs_budget": costs[2]})
    assert told == {k: v for k, v in every.items() if query.macs[k] <= costs[2]}
    assert len(told) == 3
    declared = replace(client.info(), attrs={"macs_budget": costs[1]})
    assert answer({"macs_budget": costs[2]}, declared) == {
        k: v for k, v in every.items() if query.macs[k] <= costs[1]
    }
    cache = tmp_path / "cache"
    kept = [answer({"macs_budget": b}, cache=cache) for b in (costs[1], costs[3])]
    assert len(list(cache.glob("*.json"))) == 2
    assert [answer({"macs_budget": b}, cache=cache) for b in (costs[1], costs[3])] == kept
    assert kept[1] == every and len(kept[0]) == 2
