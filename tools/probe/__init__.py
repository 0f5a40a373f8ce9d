"""Probes: where the time of one piece goes (a decode token, a prefill step, a kernel,
the gaps between steps), for variants of it (`python -m tools.probe.<name> --help`)."""
