"""Build a small Hugging Face-layout model dir that `mlx_lm.load` reads like a real one.

    python -m tools.models.build_model --preset llama-5m --out DIR
    python -m tools.models.build_model --family qwen3 --hidden-size 128 --num-layers 2 \\
        --num-heads 4 --num-kv-heads 2 --intermediate-size 384 --vocab-size 1024 --out DIR
    python -m tools.models.build_model --preset llama-80m            # into the shared cache
    python -m tools.models.build_model --list

Flags given with --preset override that preset's fields. Without --out, the model is
built into (or found in) the cache `unikern.testing.modelgen.cached_model` uses, and its path
is printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIELDS = {  # spec key -> type, for the explicit flags
    "family": str, "hidden_size": int, "num_layers": int, "num_heads": int,
    "num_kv_heads": int, "intermediate_size": int, "vocab_size": int,
    "max_position_embeddings": int, "dtype": str, "seed": int,
}


def import_modelgen():
    """`unikern.testing.modelgen`, also from a checkout that was never pip-installed."""
    try:
        from unikern.testing import modelgen
    except ImportError:
        import types

        package = types.ModuleType("unikern")
        package.__path__ = [str(REPO / "kernel")]
        sys.modules["unikern"] = package
        from unikern.testing import modelgen
    return modelgen


def main(argv: list[str] | None = None) -> int:
    modelgen = import_modelgen()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(modelgen.PRESETS))
    parser.add_argument("--out", type=Path, help="model dir to write (default: the cache)")
    parser.add_argument("--list", action="store_true", help="print the presets and exit")
    for key, kind in FIELDS.items():
        parser.add_argument("--" + key.replace("_", "-"), type=kind)
    parser.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction)
    args = parser.parse_args(argv)

    if args.list:
        for name, spec in modelgen.PRESETS.items():
            print(f"{name:12s} {modelgen.parameter_count(name) / 1e6:7.2f}M  {spec}")
        return 0
    spec = dict(modelgen.PRESETS[args.preset]) if args.preset else {}
    for key in (*FIELDS, "tie_word_embeddings"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    try:
        spec = modelgen.normalize_spec(spec)
    except modelgen.ConfigError as error:
        parser.error(str(error))

    started = time.perf_counter()
    path = modelgen.build_model(args.out, **spec) if args.out else modelgen.cached_model(spec)
    print(f"{path}  ({modelgen.parameter_count(spec) / 1e6:.2f}M parameters, {spec['dtype']}, "
          f"{time.perf_counter() - started:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
