"""Plot one round of tools/results/h200/unikern-vs-mlx-lm-small-models.json (tools.bench.bench
on an H200, rounds R1-R7): a panel per model, unikern against mlx-lm by concurrency, each
point labelled with its ratio.

    python -m tools.bench.plot_h200 --round R7c --out tools/results/h200/unikern-vs-mlx-lm-small-models.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="tools/results/h200/unikern-vs-mlx-lm-small-models.json")
    parser.add_argument("--round", required=True)
    parser.add_argument("--variant", default="unikern as committed")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [
        r
        for r in json.loads(Path(args.json).read_text())["runs"]
        if r["round"] == args.round and r["variant"] == args.variant and len(r["rows"]) > 1
    ]
    if not runs:
        raise SystemExit(f"no multi-level runs of round {args.round!r}, variant {args.variant!r} in {args.json}")
    fig, axes = plt.subplots(1, len(runs), figsize=(4.8 * len(runs), 4.2), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        xs = [r["concurrency"] for r in run["rows"]]
        ax.plot(xs, [r["unikern_tok_s"] for r in run["rows"]], "o-", label="unikern")
        ax.plot(xs, [r["mlx_lm_tok_s"] for r in run["rows"]], "s--", label="mlx-lm")
        for r in run["rows"]:
            ax.annotate(f"{r['ratio']:.2f}x", (r["concurrency"], r["unikern_tok_s"]), fontsize=8,
                        textcoords="offset points", xytext=(4, 4))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{run['model']} ({run['repeats']} repeats)", fontsize=10)
        ax.set_xlabel("concurrent requests")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("generated tokens / s")
    axes[0][0].legend()
    device = runs[0]["platform"].get("device_name", "?")
    fig.suptitle(f"{device}, MLX CUDA ({args.round}, {runs[0]['commit'][:7]}): "
                 "stream_generate at 1, batch_generate above", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
