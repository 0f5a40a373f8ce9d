"""A model directory as GGUF for llama.cpp, through llama.cpp's own converter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# modelgen's tokenizers split text with GPT-2's own regex: tell the converter so, as its
# hash table only knows published tokenizers
CONVERT = (
    "import runpy, sys; del sys.argv[0]; root = sys.argv.pop(0); sys.path[:0] = [root, root + '/gguf-py']; "
    "import conversion.base as base; base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def convert_to_gguf(model: Path, script: Path, out: Path, outtype: str = "f32") -> Path:
    """`model` converted by `script` (llama.cpp's convert_hf_to_gguf.py) into `out`, unless
    `out` exists already."""
    if out.exists():
        return out
    done = subprocess.run([sys.executable, "-c", CONVERT, str(script.parent), str(script), str(model), "--outfile",
                           str(out), "--outtype", outtype], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"GGUF conversion failed:\n{done.stderr[-2000:]}")
    return out
