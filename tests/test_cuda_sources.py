"""The GPU kernels' package (stages/execute/cuda/): their CUDA text is read from its .cu
files, not held in Python; the package imports nothing of the execute stage outside
itself; the loader's notes and markers behave as its docstring says."""

import ast
from pathlib import Path

import pytest

from unikern.stages.execute.cuda import sources

ROOT = Path(__file__).resolve().parent.parent
CUDA = ROOT / "stages" / "execute" / "cuda"
# words every kernel body of unikern's uses and no Python text of the product needs
CUDA_WORDS = ("__syncthreads", "__shared__", "__device__", "__global__", "#pragma", "blockDim")


def strings_with_cuda(root: Path) -> list[str]:
    """`file:line` of each string literal in the Python modules under root's kernel/ and
    stages/ that holds one of CUDA_WORDS."""
    found = []
    for path in sorted([*(root / "kernel").rglob("*.py"), *(root / "stages").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and any(w in node.value for w in CUDA_WORDS):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_product_module_holds_cuda_source():
    assert strings_with_cuda(ROOT) == []


def test_the_cuda_package_imports_nothing_of_the_execute_stage_outside_itself():
    for path in CUDA.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                if name.startswith("unikern"):
                    assert name.startswith(("unikern.platform", "unikern.stages.execute.cuda")), (path.name, name)
                else:
                    assert name.split(".")[0] in {"mlx", "numpy", "__future__", "functools", "importlib", "typing"}, \
                        (path.name, name)


def test_every_kernel_text_file_is_read_by_a_module_and_shipped():
    """Each .cu/.cuh/.h file here is named by a module of the package, and pyproject.toml
    ships the three kinds as package data."""
    code = "".join(p.read_text() for p in CUDA.glob("*.py"))
    files = [p.name for p in CUDA.iterdir() if p.suffix in (".cu", ".cuh", ".h")]
    assert files and all(f'"{name}"' in code for name in files), files
    assert '"unikern.stages.execute.cuda" = ["*.cu", "*.cuh", "*.h"]' in (ROOT / "pyproject.toml").read_text()


def test_text_drops_a_files_leading_notes_only():
    head = (CUDA / "q4_gemv_rope.cu").read_text().splitlines(keepends=True)
    assert head[0].startswith("//")
    text = sources.text("q4_gemv_rope.cu")
    assert not text.startswith("//") and text.startswith("        float y")
    assert "//@ ROPE_STORE\n" in text  # (a marker is not a note)


def test_fill_replaces_each_marker_line_once_and_refuses_a_stray_one():
    source = "a;\n//@ ONE\nb;\n//@ TWO\n"
    assert sources.fill(source, ONE="x;\n", TWO="") == "a;\nx;\nb;\n"
    with pytest.raises(ValueError, match="THREE"):
        sources.fill(source, ONE="", TWO="", THREE="")
    with pytest.raises(ValueError, match="still holds a marker"):
        sources.fill(source, ONE="")
    with pytest.raises(ValueError, match="no longer holds"):
        sources.renamed("out[i] = x;", ("in[", "x["))
