"""Benchmarks: unikern against mlx-lm, llama.cpp or another of its own settings, printing
the figures and their ratios (`python -m tools.bench.<name> --help`)."""
