"""Every relative link and every script, config or test path named in the README, in docs/, in each study's README
(``experiments/*/README.md``, and their index) and in the benchmarks' pages (``benchmarks/*.md``) resolves: a moved
or deleted file breaks this test, not a reader's click. And every record and figure a study or a benchmark keeps is
named by one of those pages: a record nobody cites is a record nobody can tell the meaning of."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "experiments" / "README.md",
         *sorted((REPO / "experiments").glob("*/README.md")), *sorted((REPO / "benchmarks").glob("*.md"))]
RECORDS = sorted(p for pattern in ("experiments/*/*.json", "experiments/*/*.png", "benchmarks/results/*.json")
                 for p in REPO.glob(pattern))
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target)
FOLDERS = "scripts|configs|tests|docs|rloo_lightning|benchmarks|experiments"
PATH = re.compile(rf"(?<![\w/.-])((?:{FOLDERS})/[\w./-]+\.(?:py|sh|sbatch|yaml|json|md|png|svg|csv|jsonl))\b")
# the lab's scripts run as modules: `python -m experiments.<study>.<script>`, `python -m benchmarks[.]<name>`
MODULE = re.compile(r"\bpython -m ((?:benchmarks|experiments)(?:\.\w+)+|benchmarks [a-z]\w*)")


def _targets(page: Path) -> list[tuple[str, Path]]:
    text = page.read_text()
    found = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):  # a URL, a mail, an anchor
            continue
        found.append((target, (page.parent / target.split("#")[0]).resolve()))
    for path in PATH.findall(text):
        found.append((path, REPO / path))
    for module in MODULE.findall(text):
        found.append((module, REPO / f"{module.replace('.', '/').replace(' ', '/')}.py"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_link_and_named_path_resolves(page):
    missing = sorted({name for name, path in _targets(page) if not path.exists()})
    assert not missing, f"{page.relative_to(REPO)} names files that do not exist: {missing}"


def test_a_broken_link_and_a_missing_script_are_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See [the report](gone.md#top), [the site](https://example.org), `scripts/gone.py`, "
                    "[here](#anchor) and `configs/quickstart.yaml`; run `python -m experiments.gone.gone`, "
                    "`python -m benchmarks nope --quick`, `python -m benchmarks bench` and "
                    "`python -m benchmarks.bench_trl --spec s.json`.")
    found = {name: path.exists() for name, path in _targets(page)}
    assert found == {"gone.md#top": False, "scripts/gone.py": False, "configs/quickstart.yaml": True,
                     "experiments.gone.gone": False, "benchmarks nope": False, "benchmarks bench": True,
                     "benchmarks.bench_trl": True}


def test_the_pages_cover_the_studies_and_benchmarks():
    names = {str(p.relative_to(REPO)) for p in PAGES}
    assert {"docs/results.md", "benchmarks/README.md"} <= names
    studies = sorted(p.parent.name for p in (REPO / "experiments").glob("*/*.py"))
    assert studies and all(f"experiments/{s}/README.md" in names for s in studies), studies


@pytest.mark.parametrize("record", RECORDS, ids=[str(p.relative_to(REPO)) for p in RECORDS])
def test_every_record_and_figure_is_named_by_a_page(record):
    named = {path.resolve() for page in PAGES for _, path in _targets(page)}
    assert record.resolve() in named, f"no page links or names {record.relative_to(REPO)}"


def test_the_layout_names_every_module():
    """docs/layout.md maps the package: every module under rloo_lightning/ is named there by its path in the package
    (`engines/base.py`), and every package path it names is a module that exists."""
    layout = (REPO / "docs" / "layout.md").read_text()
    package = REPO / "rloo_lightning"
    modules = sorted(str(p.relative_to(package)) for p in package.rglob("*.py"))
    missing = [m for m in modules if f"`{m}`" not in layout]
    assert not missing, f"docs/layout.md does not name these modules of rloo_lightning/: {missing}"
    outside = tuple(f"{folder}/" for folder in FOLDERS.split("|"))  # repository paths: the test above checks them
    named = set(re.findall(r"`([\w/]+\.py)`", layout))
    gone = sorted(n for n in named if not n.startswith(outside) and not (package / n).is_file())
    assert not gone, f"docs/layout.md names modules that rloo_lightning/ does not hold: {gone}"
