"""Execution: the stage that owns the model thread, the runner (the only tensor code of a
step), the paged cache adapter, sampling and the CPU kernels."""
