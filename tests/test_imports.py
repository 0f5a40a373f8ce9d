"""The command line imports the tokenizer's stack without PyTorch (unikern.platform.imports),
and PyTorch stays importable for unikern's own users of it. Each case is a fresh
interpreter: the first import of transformers decides for the whole process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# what the process imported, what transformers believes, and whether PyTorch still works
REPORT = """
import json, sys
import transformers.utils
from unikern.stages.models import default_model_path
from mlx_lm.utils import load_tokenizer
tokenizer = load_tokenizer(default_model_path())
report = {"ids": tokenizer.encode("hello world"), "torch_imported": "torch" in sys.modules,
          "transformers_sees_torch": transformers.utils.is_torch_available(), "trio_imported": "trio" in sys.modules}
import torch
report["torch_works"] = int(torch.arange(3).sum()) == 3
import trio
report["trio_works"] = trio.run(trio.sleep, 0) is None
print(json.dumps(report))
"""


def _run(code: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, lines  # nothing but the report on stdout (a worker's protocol)
    return json.loads(lines[0])


def test_tokenizer_stack_without_torch_then_torch_on_demand() -> None:
    hidden = _run("from unikern.platform.imports import import_tokenizer_stack\n"
                  "assert import_tokenizer_stack()\n" + REPORT)
    from mlx_lm.utils import load_tokenizer

    from unikern.stages.models import default_model_path

    # the same tokenizer as this process' own, whose transformers sees PyTorch
    assert hidden["ids"] == load_tokenizer(default_model_path()).encode("hello world")
    assert not hidden["torch_imported"] and not hidden["transformers_sees_torch"]
    assert hidden["torch_works"]  # the bridge and the CPU kernels import it directly
    assert not hidden["trio_imported"] and hidden["trio_works"]  # (httpcore's import of it skipped)


def test_a_process_that_chose_already_is_left_alone() -> None:
    report = _run("import json, sys\nimport torch\nfrom unikern.platform.imports import import_tokenizer_stack\n"
                  "print(json.dumps({'did': import_tokenizer_stack(), 'torch': sys.modules['torch'] is not None,\n"
                  "                  'imported': 'mlx_lm' in sys.modules or 'transformers' in sys.modules}))")
    assert report == {"did": False, "torch": True, "imported": False}


# entry() with main() replaced: what the process had imported when main() would have run
ENTRY = """
import json, sys
from unikern.frontends import cli
def main():
    import transformers.utils
    print(json.dumps({"torch_imported": "torch" in sys.modules,
                      "transformers_sees_torch": transformers.utils.is_torch_available()}))
    return 0
cli.main = main
cli.entry()
"""


def test_the_command_line_entry_hides_torch_unless_asked() -> None:
    assert _run(ENTRY) == {"torch_imported": False, "transformers_sees_torch": False}
    assert _run(ENTRY, UNIKERN_IMPORT_TORCH="1")["transformers_sees_torch"]


def test_a_stack_that_needs_torch_is_imported_with_it(tmp_path) -> None:
    """A release that imports PyTorch unguarded: the attempt is undone, and PyTorch and
    that module import as usual afterwards."""
    (tmp_path / "needs_torch.py").write_text("import torch\nVALUE = int(torch.ones(2).sum())\n")
    report = _run(f"import json, sys\nsys.path.insert(0, {str(tmp_path)!r})\n"
                  "from unikern.platform.imports import import_tokenizer_stack\n"
                  "did = import_tokenizer_stack(('needs_torch',))\n"
                  "left = 'needs_torch' in sys.modules or 'torch' in sys.modules\n"
                  "import needs_torch\n"
                  "print(json.dumps({'did': did, 'left': left, 'value': needs_torch.VALUE}))")
    assert report == {"did": False, "left": False, "value": 2}
