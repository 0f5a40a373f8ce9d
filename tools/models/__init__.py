"""Model builders: small Hugging Face-layout models for tests and benchmarks, and the
embedded default model's training (`python -m tools.models.<name> --help`)."""
