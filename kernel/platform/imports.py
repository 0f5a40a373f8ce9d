"""The tokenizer's imports without PyTorch (and trio), for the `unikern` process.

mlx-lm's tokenizer utilities import transformers, and transformers 5 imports PyTorch
wherever PyTorch is installed (`configuration_utils` through `modeling_rope_utils`); the
tokenizer's load then reaches torchvision and `torch._dynamo` where those are installed.
None of that serves a tokenizer. On the H200 image it was most of a warm start's 14-15 s
(`python -X importtime`, tools/device/h200_gpu.sh's importtime step), and about half of the
process start on the CPU machine.

`import_tokenizer_stack()` imports them while `import torch` fails, so transformers records
PyTorch as absent, then lets PyTorch be imported again: unikern's own users of it (the
zero-copy bridge, the CPU backend's attention) import it directly and still get it.
trio is hidden the same way (HIDDEN_WHILE_IMPORTING); anyio imports it again on demand.
The command line does this first thing. A program embedding unikern may call it too, if it
does not use transformers' PyTorch models: the first import of transformers decides for
the whole process.
"""

from __future__ import annotations

import importlib
import sys

# hidden from the stack's first import only. trio: httpcore (huggingface_hub's HTTP client)
# imports it wherever it is installed, for async use under trio, which nothing of the
# command line's makes (it runs asyncio): 0.23 s of an H100 host's import (`-X importtime`,
# tools/results/h200/importtime-worker-h100-74a3921.txt), 0.08 s on the CPU machine
HIDDEN_WHILE_IMPORTING = ("torch", "trio")
NEVER_USED = ("torchvision", "torchaudio")  # unikern never imports these: hidden for good
# (unless the stack turns out to need PyTorch)


def import_tokenizer_stack(modules: tuple[str, ...] = ("mlx_lm.utils",)) -> bool:
    """Import mlx-lm (and with it transformers) with PyTorch hidden. Returns False and
    does nothing when transformers or PyTorch is already imported: then the process has
    chosen already. Should one of them need PyTorch to import after all (a release that
    imports it unguarded), False: PyTorch is importable again and the rest of the
    process imports them as usual."""
    if any(name in sys.modules for name in ("transformers", "mlx_lm", *HIDDEN_WHILE_IMPORTING)):
        return False
    for name in (*HIDDEN_WHILE_IMPORTING, *NEVER_USED):
        sys.modules.setdefault(name, None)  # None: `import` raises and `find_spec` says absent
    failed = False
    try:
        for module in modules:  # transformers and its availability checks, cached
            importlib.import_module(module)
        from transformers.utils import is_torch_available

        is_torch_available()  # the check is cached: fix it while PyTorch is hidden
    except ImportError as exc:  # Python has dropped the module that failed; the ones that
        # finished keep their view without PyTorch (extension modules cannot be imported twice)
        failed = True
        # stderr, not the log: this runs before logging is set up, and a worker's stdout
        # carries its protocol
        print(f"unikern: transformers or mlx-lm needs PyTorch to import ({exc}); importing them with it "
              f"(UNIKERN_IMPORT_TORCH=1 skips the attempt)", file=sys.stderr)
        return False
    finally:  # PyTorch comes back; so do torchvision and torchaudio if the stack needs PyTorch
        for name in (*HIDDEN_WHILE_IMPORTING, *(NEVER_USED if failed else ())):
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
    return True
