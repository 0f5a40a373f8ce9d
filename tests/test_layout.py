"""The shape of the tree a newcomer reads: product modules stay short, the README stays a
user's page, and no file names a figure by the run that made it instead of its machine,
date and command."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 450
MAX_README_LINES = 300
RUN_WORDS = re.compile(r"session ?[0-9]+", re.IGNORECASE)


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return out.stdout.splitlines()


def test_no_product_module_is_longer_than_450_lines():
    modules = [p for top in ("kernel", "stages") for p in (ROOT / top).rglob("*.py")]
    assert modules
    long = {str(p.relative_to(ROOT)): n for p in modules if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these by responsibility: {long}"


def test_the_readme_is_a_page_not_a_log():
    assert len((ROOT / "README.md").read_text().splitlines()) <= MAX_README_LINES


def test_no_tracked_file_names_a_run_instead_of_its_machine_and_date():
    hits = []
    for name in tracked_files():
        if RUN_WORDS.search(name):
            hits.append(name)
            continue
        path = ROOT / name
        if not path.is_file() or path.suffix in {".png", ".safetensors"}:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        hits += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for m in RUN_WORDS.finditer(text)]
    assert not hits, hits
