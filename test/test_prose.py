"""The prose cites what exists: every module, attribute, test and file that the package's
docstrings and comments (and the docs) name resolves, and every measured figure the code
leans on is cited by the name of its section in docs/benchmarks.md, where it lives."""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path
from typing import Iterator, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "capsule_ros"
TESTS = REPO / "test"
GENERATED = ("msg", "srv", "action", "_version")      # made by the build (rosidl, CMake), not in the source tree

MODULE_REF = re.compile(r"\bcapsule_ros(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
TEST_REF = re.compile(r"\b(?:test/)?(test_[a-z0-9_]+)\.py(?:::(test_[a-z0-9_]+))?")
BARE_TEST_REF = re.compile(r"(?<![\w./-])(test_[a-z0-9_]+)\b(?!\.py|\(|\s*=)")
PATH_REF = re.compile(r"(?<![\w./-])((?:docs|config|launch|bench|examples|tools|scripts|srv|msg|action|runtime|"
                      r"policies|capsules|serving|updates|bag|ros|bt|cli|benchmarks|sim)/[\w./-]*\.[a-z0-9]+)\b")
# files at the top of the repository, cited by their bare name (a user's own pyproject.toml is not one of them)
TOP_REF = re.compile(r"(?<![\w./-])([A-Z][A-Z0-9_-]*\.md|CMakeLists\.txt|package\.xml|setup\.py|setup\.sh|Makefile|"
                     r"ruff\.toml|mypy\.ini|pytest\.ini)\b")
# a document's neighbours in docs/, cited by their bare name from another document there
DOC_REF = re.compile(r"(?<![\w./-])([a-z][a-z0-9-]*\.md)\b")
BENCH_REF = re.compile(r"docs/benchmarks\.md,?\s+\"([^\"]+)\"")


def sources() -> Iterator[Tuple[str, str]]:
    """(where, text) of the package's modules and of the docs."""
    for path in sorted(PACKAGE.rglob("*.py")):
        yield str(path.relative_to(REPO)), path.read_text()
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        yield str(path.relative_to(REPO)), path.read_text()


def prose(where: str, text: str) -> str:
    """The docstrings and comments of a module (the whole text of a document)."""
    if not where.endswith(".py"):
        return text
    parts: List[str] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    parts += [line.split("#", 1)[1] for line in text.splitlines() if "#" in line and not line.strip().startswith(
        ("'", '"'))]
    return "\n".join(parts)


@cache
def names_in(path: Path) -> Set[str]:
    """Top-level and class-level names a module defines (functions, classes, assignments)."""
    out: Set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            out.update(alias.asname or alias.name for alias in node.names)
    if path.name == "__init__.py":
        out.update(re.findall(r'"([A-Za-z_]\w*)": "capsule_ros', path.read_text()))   # lazy exports
    return out


def resolves(dotted: str) -> bool:
    """``capsule_ros.a.b[.Name[.attr]]``: a module of the source tree, then names it defines."""
    parts = dotted.split(".")
    path = REPO
    for i, part in enumerate(parts):
        if (path / part).is_dir():
            path = path / part
            continue
        if (path / f"{part}.py").is_file():
            module = path / f"{part}.py"
            rest = parts[i + 1:]
            return not rest or rest[0] in names_in(module)
        if i == 1 and part in GENERATED:
            return True
        init = path / "__init__.py"
        return init.is_file() and part in names_in(init)
    return True


@cache
def known_test_names() -> Set[str]:
    out = {path.stem for path in TESTS.glob("test_*.py")}
    for path in TESTS.glob("test_*.py"):
        out |= {n for n in names_in(path) if n.startswith("test_")}
    return out


def benchmark_sections() -> List[str]:
    text = (REPO / "docs" / "benchmarks.md").read_text()
    return [line.lstrip("#").strip().replace("`", "") for line in text.splitlines() if line.startswith("#")]


def is_module_name(dotted: str) -> bool:
    """Whether ``capsule_ros.<x>...`` names a part of the package at all (docs also show
    keys of bag and program metadata that start with ``capsule_ros.``)."""
    head = dotted.split(".")[1]
    return (PACKAGE / head).is_dir() or (PACKAGE / f"{head}.py").is_file() or head in GENERATED


def unresolved() -> List[str]:
    bad: List[str] = []
    for where, text in sources():
        bad += unresolved_in(where, prose(where, text))
    return bad


def unresolved_in(where: str, body: str) -> List[str]:
    """What the prose ``body`` of ``where`` cites that does not exist."""
    bad = []
    sections = benchmark_sections()
    for dotted in MODULE_REF.findall(body):
        if (where.endswith(".py") or is_module_name(dotted)) and not resolves(dotted.rstrip(".")):
            bad.append(f"{where}: {dotted}")
    for module, function in TEST_REF.findall(body):
        path = TESTS / f"{module}.py"
        if not path.is_file() or (function and function not in names_in(path)):
            bad.append(f"{where}: {module}.py" + (f"::{function}" if function else ""))
    for name in BARE_TEST_REF.findall(body):
        if name not in known_test_names():
            bad.append(f"{where}: {name}")
    for ref in PATH_REF.findall(body):
        ref = ref.rstrip(".")
        if not any((base / ref).exists() for base in (REPO, PACKAGE)) and not any(REPO.glob(f"examples/**/{ref}")):
            bad.append(f"{where}: {ref}")
    for ref in TOP_REF.findall(body):
        if not (REPO / ref).is_file():
            bad.append(f"{where}: {ref}")
    if where.startswith("docs/"):
        bad += [f"{where}: {ref}" for ref in DOC_REF.findall(body) if not (REPO / "docs" / ref).is_file()]
    for cited in BENCH_REF.findall(body):
        cited = " ".join(cited.split())
        if not any(section.startswith(cited) for section in sections):
            bad.append(f"{where}: docs/benchmarks.md \"{cited}\"")
    return bad


def test_cited_modules_tests_files_and_benchmark_sections_exist():
    assert unresolved() == []


@pytest.mark.parametrize("dotted, ok", [("capsule_ros.serving.session.PolicySession", True),
                                        ("capsule_ros.serving.session.NoSuchThing", False),
                                        ("capsule_ros.bag.targets", True), ("capsule_ros.nowhere", False),
                                        ("capsule_ros.srv", True)])
def test_the_resolver_itself(dotted, ok):
    assert resolves(dotted) is ok


@pytest.mark.parametrize("where, text, bad", [
    ("capsule_ros/serving/verbs.py", "the external contract: DESIGN.md section 2", ["DESIGN.md"]),
    ("capsule_ros/x.py", "CMakeLists.txt lists the interfaces; README.md says how", []),
    ("capsule_ros/x.py", "see docs/nowhere.md and config/policy.yaml", ["docs/nowhere.md"]),
    ("docs/onnx.md", "[the figures](benchmarks.md#x), [elsewhere](nowhere.md)", ["nowhere.md"]),
])
def test_file_citations_outside_the_source_tree_are_caught(where, text, bad):
    assert unresolved_in(where, text) == [f"{where}: {ref}" for ref in bad]


# A figure measured on some machine as documents write one: a time with decimals ("62.7 us"),
# a percentile with its value ("p99 5.4 ms"), a ratio with decimals ("1.12x", but not a
# target: "at most 1.1x"), an approximate time, size or throughput ("~1.1 ms", "~6 MiB",
# "220 MB/s"), a time per step or call ("472 ms per step"). Limits, defaults and sizes of
# formats are written as whole numbers ("20 ms", "500 ms", "256 MiB") and are not caught.
DOC_FIGURE = re.compile(r"(?<![\w.])\d+\.\d+\s*(?:us|µs|ms|s)\b|\bp(?:50|95|99)\s+\d+(?:\.\d+)?\s*(?:us|ms|s)\b|"
                        r"(?<![\w.])\d+\.\d+x\b|~\s?\d+(?:\.\d+)?\s*(?:us|ms|s|KiB|MiB|GiB|KB|MB|GB)\b|"
                        r"\d+(?:\.\d+)?\s*(?:KB|MB|GB|KiB|MiB|GiB)/s\b|"
                        r"\d+(?:\.\d+)?\s*(?:us|ms|s)\s+(?:per step|a step|per call|a call|each)\b")
TARGET_WORDS = ("at most", "within", "<=", "≤", "target")


def doc_figures(text: str) -> List[str]:
    """The measured figures ``DOC_FIGURE`` finds in ``text``, targets left out."""
    return [m.group(0) for m in DOC_FIGURE.finditer(text)
            if not any(word in text[max(0, m.start() - 12):m.start()] for word in TARGET_WORDS)]


@pytest.mark.parametrize("text, found", [
    ("the served step took 62.7 us against 56.1 us (1.12x)", ["62.7 us", "56.1 us", "1.12x"]),
    ("commit p50 1.6 ms / p99 5.4 ms", ["p50 1.6 ms", "p99 5.4 ms"]),
    ("reading the file (~1.1 ms for 144 KB), peak ~6 MiB, 220 MB/s", ["~1.1 ms", "~6 MiB", "220 MB/s"]),
    ("an ACT step takes 472 ms per step", ["472 ms per step"]),
    ("an answer within 20 ms at p99; the default is 500 ms; a 256 MiB payload", []),
    ("the target is at most 1.1x the plain loop; config 2.0 scale; ros2 0.36.1", []),
])
def test_the_document_figure_finder(text, found):
    assert doc_figures(text) == found


def test_measured_figures_live_only_in_docs_benchmarks_md():
    """The README and the docs cite the sections of docs/benchmarks.md (with its command,
    date and machine) instead of pasting a measured figure, which goes stale where it is."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        if path.name != "benchmarks.md":
            found += [f"{path.relative_to(REPO)}: {figure}" for figure in doc_figures(path.read_text())]
    assert found == []


def test_measured_figures_are_cited_not_pasted_into_the_code():
    """A figure measured on some machine (``measured ...``, ``~3.8 ms``, ``on the H200``)
    goes stale in a docstring; the code names the section of docs/benchmarks.md instead."""
    pasted = re.compile(r"measured[^.\n]*\d|~\d+(?:\.\d+)?\s*(?:ms|us|s|MiB|GiB)\b|\d+(?:\.\d+)?\s*(?:ms|us)\s+"
                        r"(?:at p\d\d|per step|on the)|on the H200[^.\n]*\d")
    found = []
    for where, text in sources():
        if where.endswith(".py") and "/benchmarks/" not in where:
            found += [f"{where}: {m.group(0)}" for m in pasted.finditer(prose(where, text))]
    assert found == []
