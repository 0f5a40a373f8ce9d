"""For tests and tools only, never imported by the runtime: small seeded models built
through transformers, and the mlx-lm greedy reference with its near-tie rule."""
