"""Malicious clients (`hetfl.attacks`): each attack's upload by hand on a tiny model, the
malicious set (seeded, fixed, resume-safe, given the largest model), honest clients
untouched, and bad settings refused with clear errors."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import yaml

from hetfl.algorithms.parts.architecture_choice import ArchitectureChoice, Candidate
from hetfl.algorithms.parts.width_assignment import WidthAssignment
from hetfl.assembly import build_parts
from hetfl.attacks.malicious import OnlyMalicious, declared_attrs, draw_malicious
from hetfl.attacks.poisoning import ATTACK_PURPOSE, Flip, Poison
from hetfl.config import ConfigError, validate
from hetfl.core.client.program import Programs
from hetfl.core.init import initialize
from hetfl.core.rng import SERVER, sibling_generator, torch_generator
from hetfl.core.server.assign import LARGEST, LargestClaims
from hetfl.core.spec import Spec
from hetfl.core.training import LocalTraining
from hetfl.core.types import (
    ClientData,
    ClientInfo,
    ClientOutput,
    ClientResult,
    ClientTask,
    PassRecord,
)
from hetfl.models.base import PlainFamily
from hetfl.runner import build_simulation
from hetfl.systems.costs import MacCounter

FAMILY = PlainFamily("linear", (2,), 3)

# -- a fake honest program whose "training" is known exactly --------------------------------------
X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0]])
Y = torch.tensor([0, 1, 2, 0])


@dataclass
class Recorder:
    """Honest training that moves every weight by +1 on the true labels and by +3 on any
    other labelling, and records what it was given."""

    cid: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seen: list = field(default_factory=list)

    def fit(self, task, data, private, generator, *, info, channel=None):
        self.seen.append(
            (data.y_train.clone(), generator.get_state(), generator.initial_seed(), info)
        )
        torch.rand(5, generator=generator)  # training consumes its generator
        moved = 1.0 if torch.equal(data.y_train, Y) else 3.0
        tensors = {k: v + moved for k, v in task.payload.items()}
        tensors["steps"] = torch.tensor(7)
        spec = task.spec
        result = ClientResult(
            task.cid, tensors, data.n_train, 2, 0.5, passes=[PassRecord(spec, "train", 4, 2)]
        )
        return ClientOutput(result=result, private={})

    def evaluate(self, *args):
        raise NotImplementedError


def _task() -> ClientTask:
    payload = {"w": torch.tensor([1.0, -2.0]), "steps": torch.tensor(0)}
    return ClientTask(0, PlainFamily("linear", (2,), 3).global_spec([]), payload, [])


def _data() -> ClientData:
    return ClientData(0, X, Y, X[:0], Y[:0], 3)


def _fit(program, generator=None):
    data = _data()
    gen = generator or torch_generator(0, 1, 0, "train")
    return program.fit(_task(), data, {}, gen, info=data.info())


@pytest.mark.parametrize(("keep_honest", "moved"), [(True, 1.0 + 2.5 * 3.0), (False, 2.5 * 3.0)])
def test_poisoned_uploads_by_hand(keep_honest: bool, moved: float) -> None:
    """Eq. 1: w + (w_h - w) + λ(w_p - w) = w + 1 + 2.5·3; scaled alone: w + 2.5·3. The poisoned
    pass starts from the honest pass's generator state (same batch order), its labels are
    Y permuted by the "attack" sibling; both passes are charged; integers stay honest."""
    honest = Recorder()
    gen = torch_generator(0, 1, 0, "train")
    start = gen.get_state()
    out = _fit(Poison(2.5, keep_honest)(honest), gen)
    assert torch.equal(out.result.tensors["w"], torch.tensor([1.0, -2.0]) + moved)
    assert int(out.result.tensors["steps"]) == 7
    (y_h, state_h, seed_h, _), (y_p, state_p, seed_p, _) = honest.seen
    assert torch.equal(y_h, Y) and torch.equal(state_h, start) and torch.equal(state_p, start)
    assert seed_p == seed_h
    order = torch.randperm(4, generator=sibling_generator(gen, ATTACK_PURPOSE))
    assert torch.equal(y_p, Y[order]) and not torch.equal(y_p, Y)
    assert [p.count for p in out.result.passes] == [2, 2]
    assert out.result.loss == 0.5 and out.result.num_steps == 2


def test_label_flip_by_hand_on_a_linear_model() -> None:
    """One full-batch SGD step (lr 1) from zero weights on a 2-feature, 3-class linear model:
    softmax is uniform, so the bias becomes mean(onehot(y)) - 1/3. Flipping 0 -> 2 makes
    y = [2, 1, 2, 2]: bias [-1/3, -1/12, 5/12]. The label mask follows the flipped labels."""
    family = PlainFamily("linear", (2,), 3)
    spec = family.global_spec([])
    imap = family.index_map(spec)
    state = {k: torch.zeros_like(v) for k, v in family.build(spec).state_dict().items()}
    payload = {e.local: state[e.local] for e in imap}
    task = ClientTask(0, spec, payload, imap, LocalTraining(lr=1.0, steps=1, batch_size=4))
    data = _data()
    program = Flip(0, 2)(Programs(family, seed=0).program_for(0))
    out = program.fit(task, data, {}, torch_generator(0, 1, 0, "train"), info=data.info())
    bias = next(v for k, v in out.result.tensors.items() if k.endswith("bias"))
    expected = torch.tensor([0.0, 1 / 4, 3 / 4]) - 1 / 3
    assert torch.allclose(bias, expected, atol=1e-7)
    recorder = Recorder()
    Flip(0, 2)(recorder).fit(_task(), data, {}, torch_generator(0, 1, 0, "t"), info=data.info())
    flipped_y, _, _, info = recorder.seen[0]
    assert flipped_y.tolist() == [2, 1, 2, 2] and info.labels == (1, 2)


def test_label_flip_refuses_a_class_the_data_lacks() -> None:
    with pytest.raises(ValueError, match=r"target = 5 is not a class of the data \(0..2\)"):
        _fit(Flip(0, 5)(Recorder()))


def test_honest_clients_upload_what_the_clean_run_uploads() -> None:
    """Under OnlyMalicious, a malicious client's upload changes, every other client's is
    bit-identical to its clean program's for the same inputs."""
    family = PlainFamily("mlp", (1, 2, 2), 3)
    spec = family.global_spec([])
    imap = family.index_map(spec)
    state = initialize(family.build(spec), torch_generator(0, 0, SERVER, "init")).state_dict()
    task_of = {
        cid: ClientTask(cid, spec, dict(state), imap, LocalTraining(lr=0.1, steps=2, batch_size=2))
        for cid in (0, 1, 2)
    }
    x = torch.rand(6, 1, 2, 2, generator=torch.Generator().manual_seed(3))
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    clean = Programs(family, seed=0)
    attacked = Programs(
        family, seed=0, wrappers=[OnlyMalicious(Poison(20.0, True), frozenset({1}))]
    )
    for cid in (0, 1, 2):
        data = ClientData(cid, x, y, x[:0], y[:0], 3)
        outs = [
            p.program_for(cid).fit(
                task_of[cid], data, {}, torch_generator(0, 1, cid, "train"), info=data.info()
            )
            for p in (clean, attacked)
        ]
        same = all(
            torch.equal(outs[0].result.tensors[k], v) for k, v in outs[1].result.tensors.items()
        )
        assert same == (cid != 1), cid
        assert attacked.program_for(cid).trace_fields() == {"malicious": cid == 1}


# -- the malicious set --------------------------------------------------------------------------
def test_the_malicious_set_is_seeded_and_sized() -> None:
    a = draw_malicious(range(10), 0.2, seed=3)
    assert len(a) == 2 and a == draw_malicious(range(10), 0.2, seed=3)
    assert draw_malicious(range(10), 0.0, seed=3) == frozenset()
    assert draw_malicious(range(10), 1.0, seed=3) == frozenset(range(10))
    assert len({draw_malicious(range(10), 0.2, seed=s) for s in range(6)}) > 1
    assert len(draw_malicious(range(13), 0.2, seed=0)) == 3  # round(2.6)


def _info(cid: int, **attrs) -> ClientInfo:
    return ClientInfo(cid, 10, (2,), (0, 1), attrs)


def test_widths_give_malicious_clients_the_widest_level_and_others_their_own() -> None:
    clean = WidthAssignment([0.25, 0.5, 1.0], None, lambda r: r, mode="fixed")
    attacked = WidthAssignment([0.25, 0.5, 1.0], None, lambda r: r, mode="fixed")
    clean.setup([_info(c) for c in range(6)])
    LargestClaims(attacked, FAMILY).setup(
        [_info(c, **declared_attrs({0}).get(c, {})) for c in range(6)]
    )
    # the width assignment's own record (its evaluation reads it) holds the claim
    assert attacked.level_of == {**clean.level_of, 0: 1.0} and clean.level_of[0] == 0.25
    dynamic = WidthAssignment([0.25, 0.5], None, lambda r: r, mode="dynamic")
    claims = LargestClaims(dynamic, FAMILY)
    claims.setup([])
    infos = [_info(0, **{LARGEST: True}), _info(1)]
    plain = dynamic.specs_in_round(1, [_info(0), _info(1)], torch.Generator().manual_seed(0))
    drawn = claims.specs_in_round(1, infos, torch.Generator().manual_seed(0))
    assert drawn == [0.5, plain[1]]


def test_architectures_give_malicious_clients_the_largest_and_others_their_own() -> None:
    family = PlainFamily("linear", (2,), 3)
    base = family.global_spec([]).replace(blocks=(2,), widths=(1.0,), stages=1)

    def chosen(attrs: dict) -> dict:
        choice = ArchitectureChoice(
            family,
            base,
            [Candidate(d, w) for d in (2, 3) for w in (0.5, 1.0)],
            method="fedfa",
            choice="random",
            budgets=[1e12] * 6,
            macs=MacCounter(family),
        )
        choice.macs = lambda c: c.depth * c.width  # type: ignore[method-assign]
        infos = [_info(c, **attrs.get(c, {})) for c in range(6)]
        LargestClaims(choice, family).setup_seeded(infos, torch.Generator().manual_seed(0))
        return {cid: c.label for cid, c in choice.chosen.items()}

    clean, attacked = chosen({}), chosen(declared_attrs({0, 3}))
    assert {clean[0], clean[3]} == {"d2-w0.5"} and {attacked[0], attacked[3]} == {"d3-w1"}
    assert {c: v for c, v in attacked.items() if c not in (0, 3)} == {
        c: v for c, v in clean.items() if c not in (0, 3)
    }


def _linear(classes: int) -> Spec:
    return Spec(model="linear", input_shape=(2,), num_classes=classes)


class _PluginAssignment:
    """A user's assignment that knows nothing of claims: a spec per client id at set-up,
    and one drawn per round for odd ids."""

    def __init__(self, specs: list[Spec]) -> None:
        self.specs, self.own = specs, {}

    def setup(self, clients) -> None:
        self.own = {c.cid: self.specs[c.cid % len(self.specs)] for c in clients}

    def spec_of(self, info: ClientInfo) -> Spec:
        return self.own[info.cid]

    def spec_in_round(self, round: int, info: ClientInfo, rng: torch.Generator) -> Spec:
        drawn = self.specs[int(torch.randint(len(self.specs), (1,), generator=rng))]
        return drawn if info.cid % 2 else self.own[info.cid]

    def possible_specs(self) -> list[Spec]:
        return list(self.own.values())


def test_a_plugin_assignment_wrapped_gives_claimants_the_spec_with_most_parameters() -> None:
    """Linear models 2 -> k: 3k parameters; of 3, 5 and 5 classes the largest is the first
    5-class spec (a tie goes to the first possible spec, client 1's)."""
    small, large, also = _linear(3), _linear(5), _linear(5).replace(tag="other")
    infos = [_info(c, **declared_attrs({0, 3}).get(c, {})) for c in range(6)]
    clean = _PluginAssignment([small, large, also])
    clean.setup(infos)
    claims = LargestClaims(_PluginAssignment([small, large, also]), FAMILY)
    claims.setup(infos)
    assert claims.largest == large and claims.largest != also
    assert [claims.spec_of(i) for i in infos] == [
        large if i.cid in (0, 3) else clean.spec_of(i) for i in infos
    ]
    got = [claims.spec_in_round(1, i, torch.Generator().manual_seed(i.cid)) for i in infos]
    want = [clean.spec_in_round(1, i, torch.Generator().manual_seed(i.cid)) for i in infos]
    assert got == [large if i.cid in (0, 3) else w for i, w in zip(infos, want, strict=True)]
    assert claims.possible_specs() == clean.possible_specs()  # the largest is among them
    with pytest.raises(RuntimeError, match="client 0 claims the largest model"):
        LargestClaims(clean, FAMILY).spec_of(infos[0])  # not set up
    unknown = LargestClaims(_PluginAssignment([small]), FAMILY)
    unknown.setup([])
    assert unknown.largest is None
    assert unknown.spec_in_round(1, infos[1], torch.Generator()) == small  # no claim


def test_an_attacked_run_wraps_its_assignment_and_a_clean_run_does_not() -> None:
    from golden.harness import configured

    attacked = build_parts(_attacked(0.34, 1), show_progress=False)
    clean = build_parts(validate(configured("fedavg", {})), show_progress=False)
    assert isinstance(attacked.strategy.assignment, LargestClaims)
    assert not isinstance(clean.strategy.assignment, LargestClaims)


def test_an_attack_with_the_largest_model_claim_off_keeps_the_clean_assignment() -> None:
    """`largest: false`: the malicious clients declare nothing and train what the clean
    run's assignment gives them; the section says so in summary.json and round-trips."""
    from golden.harness import configured

    section = {"kind": "scaled-poison", "fraction": 0.34, "lambda": 3, "largest": False}
    cfg = validate(configured("fedavg", {"train.rounds": 1, "attack": section}))
    parts = build_parts(cfg, show_progress=False)
    claimed = build_parts(_attacked(0.34, 1), show_progress=False)
    assert not isinstance(parts.strategy.assignment, LargestClaims)
    assert parts.attrs == {}
    assert claimed.attrs and all(a == {LARGEST: True} for a in claimed.attrs.values())
    assert parts.info["attack"]["largest"] is False
    assert "largest" not in claimed.info["attack"]  # the claim's records read as before
    assert validate(yaml.safe_load(cfg.to_yaml())).attack == cfg.attack


# -- bad settings -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("attack", "match"),
    [
        (
            {"kind": "fedfa-poison", "fraction": 1.5, "lambda": 1},
            r"attack.fraction .* \[0, 1\], got 1.5",
        ),
        ({"kind": "fedfa-poison", "fraction": -0.1, "lambda": 1}, r"attack.fraction"),
        ({"kind": "fedfa-poison", "lambda": 1}, r"attack.fraction is required"),
        (
            {"kind": "fedfa-poison", "fraction": 0.2, "lambda": 1, "largest": "yes"},
            r"attack.largest must be true .* or false",
        ),
        (
            {"kind": "fedfa-poison", "fraction": 0.2, "lambda": -1},
            r"lambda = -1: Input should be greater",
        ),
        ({"kind": "label-flip", "fraction": 0.2, "source": 1}, r"target is required"),
        ({"kind": "label-flip", "fraction": 0.2, "source": 1, "target": 1}, r"nothing would flip"),
        (
            {"kind": "fedfa-poison", "fraction": 0.2, "lambda": 1, "lamda": 2},
            r"lamda is not one of its options \(options: lambda, scale_buffers\)",
        ),
        ({"kind": "poison", "fraction": 0.2}, r"unknown attack 'poison'"),
    ],
)
def test_bad_attack_settings_are_refused(attack: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        validate({"attack": attack})


@pytest.mark.parametrize("entry", ["label-flip", {"kind": "fedfa-poison", "lambda": 20}])
def test_an_attack_under_wrappers_is_refused_with_a_pointer_to_attack(entry) -> None:
    name = entry if isinstance(entry, str) else entry["kind"]
    with pytest.raises(
        ConfigError,
        match=rf"wrappers.0: '{name}' is an attack, .* every client malicious .*"
        rf"attack: {{kind: {name}, fraction: <share of clients>",
    ):
        validate({"wrappers": [entry]})


def test_fedgkt_refuses_an_attack_by_name() -> None:
    """FedGKT's clients aggregate no model tensor: no attack reaches what they upload."""
    attack = {"kind": "fedfa-poison", "fraction": 0.2, "lambda": 100}
    with pytest.raises(
        ConfigError, match=r"attack: 'fedfa-poison' cannot attack algorithm 'fedgkt': FedGKT's"
    ):
        validate({"algorithm": "fedgkt", "attack": attack})


def test_a_fraction_that_selects_no_client_is_refused_and_zero_is_allowed() -> None:
    """round(0.2 x 2) = 0 (halves up: 0.25 x 2 = 0.5 -> 1): refused, naming the least
    fraction that selects one client; a fraction of exactly 0 is an explicit clean run."""
    two = {"data": {"num_clients": 2}, "train": {"clients_per_round": 2}}
    with pytest.raises(
        ConfigError,
        match=r"attack.fraction = 0.2 of data.num_clients = 2 rounds to 0 malicious clients.*"
        r"at least 0.25 \(one client\)",
    ):
        validate({**two, "attack": {"kind": "scaled-poison", "fraction": 0.2, "lambda": 1}})
    for fraction in (0.25, 0.0):
        attack = {"kind": "scaled-poison", "fraction": fraction, "lambda": 1}
        assert validate({**two, "attack": attack}).attack is not None


def test_a_label_flip_class_the_dataset_lacks_is_refused_before_the_run(tmp_path) -> None:
    """Digits has classes 0..9: target 12 is refused at set-up, before any training; with
    client views of 3 classes each (relabelled 0..2), so is target 5."""
    flip = {"kind": "label-flip", "fraction": 0.25, "source": 0, "target": 12}
    data = {"dataset": "digits", "num_clients": 4}
    raw = {"data": data, "train": {"clients_per_round": 4}, "attack": flip}
    with pytest.raises(ValueError, match=r"attack.target = 12 is not a class of dataset 'digits'"):
        build_simulation(validate(raw), tmp_path / "a", show_progress=False)
    views = {"groups": [{"clients": 4, "classes": 3}]}
    raw = {**raw, "data": {**raw["data"], **views}, "attack": {**flip, "target": 5}}
    with pytest.raises(ValueError, match=r"attack.target = 5 .* \(classes 0..2\)"):
        build_simulation(validate(raw), tmp_path / "b", show_progress=False)


def test_an_attack_round_trips_through_its_resolved_config() -> None:
    cfg = validate({"attack": {"kind": "fedfa-poison", "fraction": 0.2, "lambda": 20}})
    written = cfg.model_dump(mode="json")["attack"]
    assert written == {
        "kind": "fedfa-poison",
        "fraction": 0.2,
        "lambda": 20.0,
        "scale_buffers": False,
    }
    assert validate({"attack": written}).attack == cfg.attack
    assert validate({}).attack is None


# -- an attacked run: summary, trace, checkpoint, resume -----------------------------------------
def _attacked(fraction: float, rounds: int) -> dict:
    from golden.harness import configured

    return validate(
        configured(
            "fedavg",
            {
                "train.rounds": rounds,
                "train.clients_per_round": 6,
                "attack": {"kind": "scaled-poison", "fraction": fraction, "lambda": 3},
                "options.fedavg.reducer": {"kind": "multi-krum", "f": 1},
            },
        )
    )


def test_an_attacked_run_records_its_malicious_clients_and_resumes(tmp_path) -> None:
    """Scaled poison by 2 of 6 clients under Multi-Krum (f = 1): the malicious set in the
    summary, banner and trace; a run stopped after round 1 and resumed equals the whole
    run, its defence's decisions and totals included."""
    import json

    from hetfl.engine.outputs import read_metrics
    from hetfl.runner import start_banner

    cfg = _attacked(0.34, 2)
    malicious = sorted(draw_malicious(range(6), 0.34, seed=0))
    whole = build_simulation(cfg, tmp_path / "whole", show_progress=False)
    whole.setup()
    banner = start_banner(cfg, whole, tmp_path / "whole")
    assert (
        "attack: scaled-poison (lambda 3.0, scale_buffers False) by 2 malicious client(s) "
        f"(34%): {malicious}" in banner
    )
    summary = whole.run()
    assert summary["attack"] == {
        "kind": "scaled-poison",
        "fraction": 0.34,
        "lambda": 3.0,
        "scale_buffers": False,
        "malicious": malicious,
    }
    rows = read_metrics(tmp_path / "whole" / "clients.jsonl")
    assert {r["cid"] for r in rows if r["fields"]["malicious"]} == set(malicious)
    # stopped after round 1, resumed: the same run; with another fraction: refused
    part = build_simulation(_attacked(0.34, 1), tmp_path / "part", show_progress=False)
    part.run()
    resumed = build_simulation(cfg, tmp_path / "part", show_progress=False)
    continued = resumed.run(resume=True)
    for k, v in whole.state.items():
        assert torch.equal(v, resumed.state[k]), k
    # Multi-Krum's decisions before the interruption survive it: rows, trace, totals
    assert continued["defence"] == summary["defence"] and summary["defence"]["rounds"] == 2
    for name in ("metrics.jsonl", "clients.jsonl"):
        cut, uncut = (read_metrics(tmp_path / d / name) for d in ("part", "whole"))
        assert [r["defence"] for r in cut] == [r["defence"] for r in uncut]
    other = build_simulation(_attacked(0.5, 2), tmp_path / "part", show_progress=False)
    with pytest.raises(ValueError, match=r"checkpoint's malicious clients .* differ"):
        other.run(resume=True)
    assert (
        json.loads((tmp_path / "part" / "summary.json").read_text())["attack"]["malicious"]
        == malicious
    )


def test_serve_refuses_an_attack() -> None:
    from hetfl.launch.serve import refuse_attack

    with pytest.raises(ConfigError, match="simulation of malicious clients and cannot be served"):
        refuse_attack(_attacked(0.2, 1))
