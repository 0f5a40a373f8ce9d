"""Checks that run the engine under load or against a reference and pass or fail: load,
fuzzing, exit codes, greedy parity (`python -m tools.check.<name> --help`)."""
