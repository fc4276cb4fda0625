"""The code's own checks, run with the tests so CI keeps them at zero findings:
ruff (ruff.toml: style, imports, bug patterns, simplifications, blind excepts, stale
noqa) over the package, tests and tools, and mypy (mypy.ini) over the whole package,
unannotated function bodies included (the policy kinds' model code is read for its
names and signatures only; mypy.ini says why)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=REPO, timeout=600)


def test_ruff_finds_nothing():
    result = run("ruff", "check", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def test_mypy_finds_nothing_in_the_package():
    result = run("mypy", "--no-incremental")
    assert result.returncode == 0 and "Success" in result.stdout, result.stdout[-5000:] + result.stderr[-2000:]
