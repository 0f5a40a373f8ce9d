"""The BLAS preload: each case runs in a fresh interpreter, since it only works before `import mlx`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
needs_openblas = pytest.mark.skipif(
    not os.path.exists(OPENBLAS), reason="libopenblas0-pthread absent"
)


def run_python(code: str, **env: str) -> dict:
    """Run `code` in a new interpreter; it prints one JSON object as its last line."""
    environment = {k: v for k, v in os.environ.items() if k != "UNIKERN_BLAS"}
    environment.update(env)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


PRELOAD_THEN_GEMM = """
    import json
    from unikern.platform import blas
    first = blas.preload()
    second = blas.preload()
    import mlx.core as mx
    a = mx.ones((8, 64)); mx.eval(a @ a.T)
    now = blas.info()
    print(json.dumps({"first": first.library, "same": first == second,
                      "library": now.library, "source": now.source, "reason": now.reason}))
"""


@needs_openblas
def test_auto_preload_serves_mlx_from_openblas() -> None:
    got = run_python(PRELOAD_THEN_GEMM)
    assert got["first"] == OPENBLAS
    assert got["same"]  # idempotent
    assert got["library"] == OPENBLAS  # read back from libmlx's GOT slot, not assumed
    assert got["source"] == "auto"
    assert "libmlx" in got["reason"]


def test_off_leaves_the_reference_blas() -> None:
    got = run_python(PRELOAD_THEN_GEMM, UNIKERN_BLAS="off")
    assert got["library"] == "reference"
    assert got["source"] == "off"
    assert "libblas" in got["reason"]


@needs_openblas
def test_explicit_path_from_env() -> None:
    got = run_python(PRELOAD_THEN_GEMM, UNIKERN_BLAS=OPENBLAS)
    assert (got["library"], got["source"]) == (OPENBLAS, "env")


# unikern/__init__.py may call preload() itself: catch the error at import or at the call.
RAISES = """
    import json
    try:
        from unikern.platform import blas
        blas.preload()
    except Exception as exc:
        print(json.dumps({"type": type(exc).__name__, "error": str(exc)}))
    else:
        print(json.dumps({"type": None, "error": None}))
"""


def test_missing_explicit_path_is_a_config_error() -> None:
    got = run_python(RAISES, UNIKERN_BLAS="/nonexistent/libcblas.so")
    assert got["type"] == "ConfigError"
    assert "/nonexistent/libcblas.so" in got["error"]
    assert "auto" in got["error"] and "off" in got["error"]


def test_unloadable_explicit_path_is_a_config_error(tmp_path) -> None:
    bogus = tmp_path / "libnotblas.so"
    bogus.write_bytes(b"not an ELF file")
    got = run_python(RAISES, UNIKERN_BLAS=str(bogus))
    assert got["type"] == "ConfigError"
    assert "cannot load" in got["error"] and str(bogus) in got["error"]


@needs_openblas
def test_too_late_reports_what_mlx_really_bound() -> None:
    # openblas lands in the global scope after libmlx bound its symbols: the global
    # lookup says openblas, but MLX still calls the reference BLAS, and info() says so.
    got = run_python(
        f"""
        import ctypes, json
        import mlx.core as mx
        ctypes.CDLL({OPENBLAS!r}, mode=ctypes.RTLD_GLOBAL)
        from unikern.platform import blas
        chosen = blas.preload()
        print(json.dumps({{"library": chosen.library, "source": chosen.source}}))
        """
    )
    assert got == {"library": "reference", "source": "already-imported"}
