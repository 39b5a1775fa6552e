"""The import rules of docs/contracts.md "Layers" (its table of rooms), checked statically over
every module of hetfl.

Every import is found with `ast` (inside functions too, and relative imports resolved), so
a deferred import cannot slip past the rules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hetfl

SRC = Path(hetfl.__file__).parent

#: The face: the config edge, reports, the CLI and what takes the config apart into the
#: explicit parts the engines run (the simulator's runner, the assembly, the Flower apps and
#: the serve/client commands). The engines never import it.
FACE = (
    "hetfl.config",
    "hetfl.report",
    "hetfl.paired",
    "hetfl.study",
    "hetfl.cli",
    "hetfl.listing",
    "hetfl.runner",
    "hetfl.assembly",
    "hetfl.flower",
    "hetfl.launch",
    "hetfl.provenance",
    "hetfl.api",
)

#: Everything above the models and data layers (core sits below models too).
ABOVE_MODELS = (
    "hetfl.algorithms",
    "hetfl.sim",
    "hetfl.deploy",
    "hetfl.engine",
    "hetfl.systems",
    *FACE,
)

#: core's two halves: the server's (the strategy and its parts) and the client's (programs,
#: recipes, the local loop). Each imports the vocabulary, core's root, and never the other.
HALVES = ("hetfl.core.server", "hetfl.core.client")

#: The vocabulary as a rule names it: core's root modules, not its halves (`exempt`).
VOCABULARY = "hetfl.core"

#: (importing package, packages it must never import, its subpackages the rule exempts)
RULES = [
    ("hetfl.sim", ("hetfl.deploy", "hetfl.algorithms", *FACE), ()),
    ("hetfl.deploy", ("hetfl.sim", "hetfl.algorithms", *FACE), ()),
    ("hetfl.engine", ("hetfl.sim", "hetfl.deploy", "hetfl.algorithms", *FACE), ()),
    (
        "hetfl.algorithms",
        ("hetfl.attacks", "hetfl.systems", "hetfl.sim", "hetfl.deploy", "hetfl.engine", *FACE),
        (),
    ),
    (
        "hetfl.attacks",
        ("hetfl.algorithms", "hetfl.systems", "hetfl.sim", "hetfl.deploy", "hetfl.engine", *FACE),
        (),
    ),
    (
        "hetfl.systems",
        ("hetfl.algorithms", "hetfl.attacks", "hetfl.sim", "hetfl.deploy", "hetfl.engine", *FACE),
        (),
    ),
    ("hetfl.models", (*ABOVE_MODELS, "hetfl.attacks", "hetfl.data"), ()),
    ("hetfl.data", (*ABOVE_MODELS, "hetfl.attacks", "hetfl.models"), ()),
    ("hetfl.core", (*ABOVE_MODELS, "hetfl.attacks", "hetfl.models", "hetfl.data"), ()),
    ("hetfl.core.server", ("hetfl.core.client",), ()),
    ("hetfl.core.client", ("hetfl.core.server",), ()),
    (VOCABULARY, HALVES, HALVES),
]


def module_name(path: Path) -> str:
    parts = ["hetfl", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, name: str, is_package: bool = False) -> set[str]:
    """Every module the source of module `name` imports, anywhere in it, as absolute
    names; for `from a import b` both `a` and `a.b` (b may be a submodule)."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(modules: dict[str, set[str]]) -> list[str]:
    found = []
    for name, imports in sorted(modules.items()):
        for package, forbidden, exempt in RULES:
            if not within(name, package) or any(within(name, e) for e in exempt):
                continue
            for target in sorted(imports):
                for banned in forbidden:
                    if within(target, banned):
                        found.append(
                            f"{name} imports {target} ({package} must not import {banned})"
                        )
    return found


MODULES = {
    module_name(p): imported(p.read_text(), module_name(p), p.name == "__init__.py")
    for p in sorted(SRC.rglob("*.py"))
}


def test_every_package_of_the_rules_exists():
    for package, _, exempt in RULES:
        assert package in MODULES, package
        assert all(e in MODULES for e in exempt), exempt
    for face in FACE:
        assert face in MODULES, face


@pytest.mark.parametrize("package", sorted({p for p, _, _ in RULES}))
def test_layers_hold(package):
    bad = [v for v in violations(MODULES) if v.startswith(package)]
    assert not bad, "\n".join(bad)


def test_the_scan_finds_deferred_and_relative_imports():
    source = "def f():\n    from hetfl.runner import build_simulation\n\nfrom ..sim import engine\n"
    found = imported(source, "hetfl.deploy.x")
    assert {"hetfl.runner", "hetfl.sim", "hetfl.sim.engine"} <= found
    assert violations({"hetfl.deploy.x": found}) == [
        "hetfl.deploy.x imports hetfl.runner (hetfl.deploy must not import hetfl.runner)",
        "hetfl.deploy.x imports hetfl.runner.build_simulation "
        "(hetfl.deploy must not import hetfl.runner)",
        "hetfl.deploy.x imports hetfl.sim (hetfl.deploy must not import hetfl.sim)",
        "hetfl.deploy.x imports hetfl.sim.engine (hetfl.deploy must not import hetfl.sim)",
    ]
    assert violations({"hetfl.sim.y": found}) == [
        "hetfl.sim.y imports hetfl.runner (hetfl.sim must not import hetfl.runner)",
        "hetfl.sim.y imports hetfl.runner.build_simulation "
        "(hetfl.sim must not import hetfl.runner)",
    ]


def test_the_rooms_of_core_and_the_new_rules_are_caught():
    """The halves import only the vocabulary, the vocabulary neither half; a method does not
    import the systems layer (its prices are injected), an engine no method."""
    found = {
        "hetfl.core.server.x": {"hetfl.core.client.loop", "hetfl.core.state"},
        "hetfl.core.client.x": {"hetfl.core.server.strategy", "hetfl.core.types"},
        "hetfl.core.x": {"hetfl.core.server", "hetfl.core.spec"},
        "hetfl.algorithms.x": {"hetfl.systems.costs", "hetfl.core.server.assign"},
        "hetfl.deploy.x": {"hetfl.algorithms.parts.method_registry", "hetfl.core.simulator_only"},
    }
    assert [v.split(" (")[0] for v in violations(found)] == [
        "hetfl.algorithms.x imports hetfl.systems.costs",
        "hetfl.core.client.x imports hetfl.core.server.strategy",
        "hetfl.core.server.x imports hetfl.core.client.loop",
        "hetfl.core.x imports hetfl.core.server",
        "hetfl.deploy.x imports hetfl.algorithms.parts.method_registry",
    ]


@pytest.mark.parametrize("engine", ["hetfl.sim.x", "hetfl.deploy.x", "hetfl.engine.x"])
def test_an_engine_reading_the_config_or_writing_reports_is_caught(engine):
    """The engines take explicit parts: a deferred import of the config or the report
    (the face) is a violation, as is one of the face's builders."""
    source = "def f():\n    from hetfl.config import RunConfig\n    import hetfl.report\n"
    found = imported(source + "from hetfl.flower import build_node\n", engine)
    package = engine.rpartition(".")[0]
    assert [v.split(" (")[0] for v in violations({engine: found})] == [
        f"{engine} imports {m}"
        for m in (
            "hetfl.config",
            "hetfl.config.RunConfig",
            "hetfl.flower",
            "hetfl.flower.build_node",
            "hetfl.report",
        )
    ]
    assert f"({package} must not import hetfl.config)" in violations({engine: found})[0]


# -- citations -------------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]
CITED_TREES = ("src", "docs", "configs")


def cited_files() -> list[Path]:
    files = [p for tree in CITED_TREES for p in (REPO / tree).rglob("*") if p.is_file()]
    return [*files, REPO / "README.md"]


def test_code_and_docs_cite_papers_not_a_file_the_repository_lacks():
    """Citations name the paper (title, section, equation) or the authors' code: the
    project's internal notes file is not in the repository, so a reference to it is dead."""
    dead = "METHODS" + ".md"
    offenders = [
        f"{path.relative_to(REPO)}:{number}"
        for path in cited_files()
        if path.suffix not in {".pyc", ".npz", ".gz"}
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if dead in line
    ]
    assert len(cited_files()) > 50  # the scan sees the trees, not an empty checkout
    assert offenders == [], f"cite the paper instead of {dead} at: {', '.join(offenders)}"


# -- method module size ----------------------------------------------------------------------------
#: A method module's cap; every top-level module of hetfl.algorithms but its `__init__` is a
#: method (the registry and the parts methods share live in hetfl.algorithms.parts).
MAX_METHOD_LINES = 160


def long_method_modules(folder: Path, limit: int = MAX_METHOD_LINES) -> dict[str, int]:
    """The method modules in `folder` (its top level: parts/ holds no method) longer than
    `limit` lines, with their line counts."""
    counts = {
        p.name: len(p.read_text().splitlines())
        for p in sorted(folder.glob("*.py"))
        if p.name != "__init__.py"
    }
    return {name: n for name, n in counts.items() if n > limit}


def test_method_modules_stay_short(tmp_path):
    """A method composes parts; one that grows past about 150 lines holds a part that
    belongs in core, models or a shared module (or discussion that belongs in
    docs/methods.md)."""
    folder = SRC / "algorithms"
    assert {"fedavg.py", "scalablefl.py", "heterofl.py"} <= {p.name for p in folder.glob("*.py")}
    assert long_method_modules(folder) == {}
    (tmp_path / "big.py").write_text("x = 1\n" * 161)
    (tmp_path / "fits.py").write_text("x = 1\n" * 160)
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "widths.py").write_text("x = 1\n" * 400)
    assert long_method_modules(tmp_path) == {"big.py": 161}


# -- the layout: one job per module -------------------------------------------------------------
def documented_layout() -> list[str]:
    """The module paths listed in docs/contracts.md, "The layout: one job per module"."""
    text = (REPO / "docs" / "contracts.md").read_text()
    section = text.split("### The layout: one job per module", 1)[1]
    block = section.split("```", 2)[1]
    return [line.split()[0] for line in block.splitlines() if line.strip()]


def test_the_documented_layout_names_every_module_and_no_other():
    actual = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py"))
    listed = documented_layout()
    missing = sorted(set(actual) - set(listed))
    stale = sorted(set(listed) - set(actual))
    assert not missing and not stale, (
        f"docs/contracts.md's layout misses {missing} and lists modules that do not exist "
        f"{stale}: give every module one line there, `path  its one job`"
    )
    assert len(listed) == len(set(listed)), "a module is listed twice"


def test_a_module_over_400_lines_says_its_one_job():
    long = {
        str(p.relative_to(SRC)): ast.get_docstring(ast.parse(p.read_text())) or ""
        for p in SRC.rglob("*.py")
        if len(p.read_text().splitlines()) > 400
    }
    vague = sorted(name for name, doc in long.items() if not doc.startswith("One job: "))
    assert not vague, f"over 400 lines without a docstring opening 'One job: ...': {vague}"
