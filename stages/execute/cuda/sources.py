"""The CUDA text of this package's kernels, read from the .cu and .cuh files beside their
modules. A file's leading `//` lines are its notes, not part of the text. A line `//@ NAME`
marks where the launching module fills in another file's text (or nothing): the texts
that several kernels share (rope_store.cu, paged attention's in block_step.cu) are
written once."""

from __future__ import annotations

import functools

from unikern.platform import cuda_text


@functools.cache
def text(name: str) -> str:
    """The text of file `name` of this package, less its leading `//` lines."""
    return cuda_text.read(__package__, name)


def fill(source: str, **parts: str) -> str:
    """`source` with each marker line `//@ NAME` replaced by parts[NAME] (a file's text,
    which ends its lines itself; "" drops the line). Every marker and every part must
    meet: a renamed marker fails here, not in the compiler."""
    for name, part in parts.items():
        marker = f"//@ {name}\n"
        if source.count(marker) != 1:
            raise ValueError(f"the kernel text holds marker {marker.strip()!r} {source.count(marker)} times, not once")
        source = source.replace(marker, part)
    if "\n//@ " in source:
        raise ValueError(f"the kernel text still holds a marker: {source[source.index(chr(10) + '//@ '):][:40]!r}")
    return source


def renamed(source: str, *renames: tuple[str, str]) -> str:
    """`source` with each name (old, new) replaced, every old one present: one kernel's
    text reused inside another, whose names differ (block_kernel.py's attention phase)."""
    for old, new in renames:
        if old not in source:
            raise ValueError(f"the kernel text no longer holds {old!r}")
        source = source.replace(old, new)
    return source
