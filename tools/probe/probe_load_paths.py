"""Two one-time costs of a start and of a first request, each against its alternative, on
the machine at hand (an H200 through MLX's CUDA backend is the one it is for):

- weights: a model's safetensors files read raw (the page cache's speed), through
  `mx.load` (MLX's own reader, what mlx-lm's load takes), and through NumPy (the file
  mapped or read whole, each tensor made an MLX array from its bytes); each then used
  once on the default device (`sum`), so a reader that leaves the bytes on the host pays
  their move there.
- sdpa: `mx.fast.scaled_dot_product_attention`'s first and second call at prefill shapes
  (causal, the model's heads), with MLX's cuDNN path allowed and not
  (MLX_CUDA_USE_CUDNN_SDPA, read once per process: each setting in a fresh process).

    python -m tools.probe.probe_load_paths weights --model DIR [--json out.json]
    python -m tools.probe.probe_load_paths sdpa --model DIR [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

from tools.probe.probe_startup import mlx_load, raw_read

# safetensors dtype -> (NumPy dtype of the bytes, MLX dtype to view them as, or None: the same)
DTYPES = {"BF16": ("uint16", "bfloat16"), "F16": ("float16", None), "F32": ("float32", None),
          "U32": ("uint32", None), "I32": ("int32", None), "U8": ("uint8", None), "I8": ("int8", None)}


def header(path: Path) -> tuple[dict, int]:
    """A safetensors file's tensor table and where its data starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        table = json.loads(f.read(n))
    table.pop("__metadata__", None)
    return table, 8 + n


def numpy_load(files: list[Path], whole: bool) -> dict:
    """Each tensor an MLX array made from its bytes, the file mapped (whole=False) or read
    into one buffer first (whole=True); then evaluated and used once."""
    import mlx.core as mx
    import numpy as np

    t = time.perf_counter()
    arrays = []
    for f in files:
        table, start = header(f)
        data = np.fromfile(f, dtype=np.uint8) if whole else np.memmap(f, dtype=np.uint8, mode="r")
        for entry in table.values():
            raw, view = DTYPES[entry["dtype"]]
            lo, hi = entry["data_offsets"]
            a = mx.array(data[start + lo:start + hi].view(raw).reshape(entry["shape"]))
            arrays.append(a.view(getattr(mx, view)) if view else a)
    mx.eval(arrays)
    read = time.perf_counter() - t
    return {**_used(arrays, t), "read_seconds": round(read, 3)}


def _used(arrays: list, t: float) -> dict:
    import mlx.core as mx

    mx.eval([a.sum() for a in arrays])
    s = time.perf_counter() - t
    total = sum(a.nbytes for a in arrays)
    return {"bytes": total, "seconds": round(s, 3), "gb_per_s": round(total / s / 1e9, 2)}


def mlx_load_used(files: list[Path]) -> dict:
    import mlx.core as mx

    t = time.perf_counter()
    arrays = []
    for f in files:
        arrays.extend(mx.load(str(f)).values())
    mx.eval(arrays)
    read = time.perf_counter() - t
    return {**_used(arrays, t), "read_seconds": round(read, 3)}


def weights(model: Path) -> dict:
    import mlx.core as mx

    files = sorted(model.glob("*.safetensors"))
    report = {"device": str(mx.default_device()), "raw_read": raw_read(files)}
    for name, run in (("mlx_load", lambda: mlx_load_used(files)), ("numpy_mapped", lambda: numpy_load(files, False)),
                      ("numpy_whole", lambda: numpy_load(files, True)), ("mlx_load_again", lambda: mlx_load(files))):
        report[name] = run()
        mx.clear_cache()
        print(f"{name:>15}: {report[name]}", file=sys.stderr)
    return report


SHAPES = [(1, 17, 17), (1, 24, 24), (1, 64, 64), (1, 100, 100), (1, 333, 333), (1, 1000, 1000), (1, 64, 1064),
          (1, 200, 1200), (4, 64, 64), (16, 64, 64)]
# several rows going on after a cached prefix: a boolean mask per row (layouts.BatchLayout)
MASKED = [(4, 296, 1280), (4, 300, 1280), (8, 296, 1280)]


def sdpa_child(model: Path) -> list[dict]:
    import mlx.core as mx

    config = json.loads((model / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    dim = config.get("head_dim") or config["hidden_size"] // heads
    rows = []
    for b, q_len, k_len in SHAPES + MASKED:
        q = mx.random.normal((b, heads, q_len, dim)).astype(mx.bfloat16)
        k = mx.random.normal((b, kv, k_len, dim)).astype(mx.bfloat16)
        v = mx.random.normal((b, kv, k_len, dim)).astype(mx.bfloat16)
        mask = "causal"
        if (b, q_len, k_len) in MASKED:  # row i starts at k_len - q_len - 8 * i
            starts = mx.array([k_len - q_len - 8 * i for i in range(b)])[:, None, None, None]
            mask = mx.arange(k_len)[None, None, None] <= starts + mx.arange(q_len)[None, None, :, None]
        mx.eval(q, k, v, *([] if isinstance(mask, str) else [mask]))
        times = []
        for _ in range(3):
            t = time.perf_counter()
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5, mask=mask))
            mx.synchronize()
            times.append(round((time.perf_counter() - t) * 1e3, 2))
        rows.append({"batch": b, "q": q_len, "k": k_len, "mask": "causal" if isinstance(mask, str) else "rows",
                     "first_ms": times[0], "second_ms": times[1], "third_ms": times[2]})
    return rows


def sdpa(model: Path) -> dict:
    report = {}
    for setting in ("1", "0"):
        env = {**os.environ, "MLX_CUDA_USE_CUDNN_SDPA": setting}
        out = subprocess.run([sys.executable, "-m", "tools.probe.probe_load_paths", "sdpa-child", "--model", str(model)],
                             env=env, capture_output=True, text=True, check=True)
        rows = json.loads(out.stdout)
        report[f"cudnn_{'on' if setting == '1' else 'off'}"] = rows
        for r in rows:
            print(f"cuDNN {'on ' if setting == '1' else 'off'} b={r['batch']:>2} q={r['q']:>4} k={r['k']:>4} {r['mask']:>6}: "
                  f"first {r['first_ms']:8.2f} ms, then {r['second_ms']:6.2f} / {r['third_ms']:6.2f}", file=sys.stderr)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["weights", "sdpa", "sdpa-child"])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.what == "sdpa-child":
        print(json.dumps(sdpa_child(args.model)))
        return 0
    report = {"model": str(args.model), **(weights(args.model) if args.what == "weights" else sdpa(args.model))}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
