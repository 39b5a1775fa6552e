"""The documentation cannot drift from the code: docs/config.md is what the generator
(tools/config_reference.py) writes from the config records, with every key described and
its defaults the records' own; every Python block of docs/api.md runs; every relative
link of the README and docs/ reaches a file (and a heading, where it names one)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import pytest
import yaml
from pydantic import BaseModel, Field

from hetfl import catalogue
from hetfl.algorithms import ALGORITHMS
from hetfl.config import RunConfig

REPO = Path(__file__).resolve().parents[1]
CONFIG_PAGE = REPO / "docs" / "config.md"


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "config_reference", REPO / "tools" / "config_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    return load_generator()


# -- docs/config.md ------------------------------------------------------------------------------
def test_config_page_is_what_the_generator_writes(generator):
    assert CONFIG_PAGE.read_text() == generator.render(), (
        f"docs/config.md is out of date: regenerate it with `{generator.COMMAND}`"
    )


def test_every_key_has_a_description(generator):
    assert generator.undescribed() == [], (
        f"give these keys a Field(description=...) in their record, then run `{generator.COMMAND}`"
    )


def page_rows(text: str) -> dict[str, tuple[str, str]]:
    """Each table row of the page: key -> (type, default), backticks stripped."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 4 and cells[0].startswith("`"):
            out[cells[0].strip("`")] = (cells[1], cells[2].strip("`"))
    return out


def leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The dotted keys of a dumped record, down to values that are not mappings."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and key not in ("options", "reducer"):
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_the_page_holds_every_default_of_a_run_config():
    """Every key of the default config (dumped by pydantic, independently of the
    generator), with the default the page shows read back as YAML."""
    rows = page_rows(CONFIG_PAGE.read_text())
    dumped = leaves(RunConfig().model_dump(mode="json"))
    assert len(dumped) > 60
    missing = sorted(set(dumped) - set(rows))
    assert missing == []
    wrong = {k: (rows[k][1], v) for k, v in dumped.items() if yaml.safe_load(rows[k][1]) != v}
    assert wrong == {}


@pytest.mark.parametrize("name", sorted(catalogue.ALGORITHMS))
def test_the_page_holds_every_option_of_every_algorithm(name):
    rows = page_rows(CONFIG_PAGE.read_text())
    dumped = leaves(ALGORITHMS.get(name).options().model_dump(mode="json"))  # records: keys
    for key, value in dumped.items():
        shown = yaml.safe_load(rows[f"options.{name}.{key}"][1])
        assert shown == (value["kind"] if key == "reducer" else value), key


class Inner(BaseModel):
    """An inner record.

    Its second paragraph is not shown."""

    depth: int = Field(2, gt=0, le=8, description="how deep")


class Toy(BaseModel):
    """A toy record."""

    size: int = Field(3, ge=1, description="how big")
    mode: Literal["a", "b"] | None = Field(None, description="which mode")
    ratios: tuple[float, ...] = Field((0.5, 1e-9), description="some ratios")
    inner: Inner = Field(Inner(), description="the inner part")
    many: list[Inner] = Field(default_factory=list, description="several")
    need: str = Field(description="<name> | other")


def test_a_record_becomes_sections_with_types_bounds_and_defaults(generator):
    sections = list(generator.record_sections(Toy, "toy.", 2, "Toy", "A toy record."))
    assert [s.title for s in sections] == ["Toy", "`toy.inner`", "`toy.many[]`"]
    assert sections[1].intro == "An inner record."
    rows = {r.key: (r.type, r.default, r.description) for r in sections[0].rows}
    assert rows == {
        "`toy.size`": ("int ≥ 1", "`3`", "how big"),
        "`toy.mode`": ("one of `a`, `b`, or null", "`null`", "which mode"),
        "`toy.ratios`": ("list of floats", "`[0.5, 1.0e-09]`", "some ratios"),
        "`toy.inner`": ("section [`toy.inner`](#toyinner)", "its keys' defaults", "the inner part"),
        "`toy.many`": ("list of [`toy.many[]`](#toymany) records", "`[]`", "several"),
        "`toy.need`": ("str", "required", "<name> | other"),
    }
    assert [(r.key, r.type) for r in sections[2].rows] == [("`toy.many[].depth`", "int > 0, ≤ 8")]
    rendered = generator.render_section(sections[0])
    assert "| `toy.need` | str | required | &lt;name> \\| other |" in rendered


# -- docs/api.md ---------------------------------------------------------------------------------
def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a Markdown page, in order."""
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_python_blocks_are_found_in_order():
    page = "a\n```python\nx = 1\n```\n```sh\nls\n```\n```python\ny = x\n```\n"
    assert python_blocks(page) == ["x = 1\n", "y = x\n"]


def test_every_python_block_of_the_api_page_runs(tmp_path):
    """The blocks, in order, as one script in a fresh interpreter (what they register stays
    there) in an empty folder (what they write, too)."""
    blocks = python_blocks((REPO / "docs" / "api.md").read_text())
    assert len(blocks) >= 6
    script = tmp_path / "api_page.py"
    script.write_text("\n\n".join(blocks))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"docs/api.md failed:\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "runs" / "small" / "summary.json").exists()


# -- links ---------------------------------------------------------------------------------------
LINKED_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """A Markdown page without its fenced code blocks (links in code are not links)."""
    return re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation other than `-` and
    `_` dropped, spaces to hyphens, `-1`, `-2`, ... after repeats."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", prose(text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def dead_links(page: Path) -> list[str]:
    """The relative links of `page` whose file, or heading in a Markdown file, is missing."""
    dead = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (
            anchor and file.suffix == ".md" and anchor not in anchors(file.read_text())
        ):
            dead.append(target)
    return dead


def test_anchors_follow_github():
    page = "# Run outputs\n## `data.groups[]`\n```\n# not a heading\n```\n## Run outputs\n"
    assert anchors(page) == {"run-outputs", "datagroups", "run-outputs-1"}


def test_a_dead_link_is_found(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-heading) [web](https://example.org/x) [self](#top)\n"
        "# Top\n[gone](missing.md) [no heading](there.md#elsewhere)\n"
        "```\n[in code](nowhere.md)\n```\n"
    )
    assert dead_links(page) == ["missing.md", "there.md#elsewhere"]


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: p.name)
def test_links_reach_their_files_and_headings(page):
    assert dead_links(page) == []
