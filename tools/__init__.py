"""unikern's own tools: benchmarks, probes, checks, the GPU machine's drivers and model
builders. Not part of the installed package.

Run every Python tool as a module from the repository root, e.g.
`python -m tools.bench.bench --help`; tools import one another as `tools.<group>.<name>`.
tools/README.md lists them by group.
"""
