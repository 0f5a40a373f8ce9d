"""CUDA text kept in files beside the Python that launches it (the stages' kernels,
stages/execute/cuda/sources.py; the wrapping of a kernel body, platform/cuda_build.py).
A file's leading `//` lines are its notes, not part of the text; a line `//== NAME`
starts a section and is text."""

from __future__ import annotations

from importlib import resources


def read(package: str, name: str) -> str:
    """The text of file `name` of `package`, less its leading `//` lines (notes)."""
    lines = resources.files(package).joinpath(name).read_text().splitlines(keepends=True)
    first = next((i for i, line in enumerate(lines) if not line.startswith("//") or line.startswith("//== ")),
                 len(lines))
    return "".join(lines[first:])


def sections(text: str) -> dict[str, str]:
    """`text`'s sections by name: each starts at a line `//== NAME` and runs to the next."""
    parts = text.split("//== ")[1:]
    return {part.split("\n", 1)[0].strip(): part.split("\n", 1)[1] for part in parts}
