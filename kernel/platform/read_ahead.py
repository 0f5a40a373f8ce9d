"""The model's weights read while the command line imports the rest.

A warm start of a 1B bf16 worker on an H200 spent about 2.7 s importing (mlx-lm's
package imports transformers) and then 1.8 s reading 2 GB of weights: one after the
other, though neither waits on the other. `start` begins reading a model directory's
safetensors files on a thread of their own (MLX's load and eval, which let go of the
GIL) as soon as `mlx.core` is imported; the execute stage's load then takes the arrays
read (`serving`): mlx-lm's `load_model` is unchanged, its `mx.load` of a file read
ahead answers with that file's arrays, already on the device.

The command line starts it (`unikern.frontends.cli.entry`) for `run`, `worker` and
`serve` with `--model DIR` (or `--set execute.model=DIR`) on one rank. UNIKERN_READ_AHEAD
picks: `auto` (the default) where MLX's default device is a CUDA GPU, `1` always, `0`
never. On an H200 a 1B worker was ready in 6.48 / 5.70 s with it against 7.27 / 7.21 s
without (tools/results/h200/startup-1b-read-ahead.json); on the two-core CPU machine it
gained nothing (a Python import beside MLX's read ran at half its speed;
docs/performance.md), hence CUDA only under `auto`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

VARIABLE = "UNIKERN_READ_AHEAD"

_lock = threading.Lock()
_pending: ReadAhead | None = None


class ReadAhead:
    """One model directory's `model*.safetensors` (the files mlx-lm's load reads), each
    loaded and evaluated on a daemon thread; `arrays()` waits for it."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir.resolve()
        self.files = sorted(str(f) for f in self.model_dir.glob("model*.safetensors"))
        self.seconds: float | None = None  # the read's own length, on its thread
        self.error: BaseException | None = None
        self._arrays: dict[str, dict[str, Any]] = {}
        self._thread = threading.Thread(target=self._read, name="unikern-read-ahead", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        import mlx.core as mx

        started = time.perf_counter()
        try:
            for file in self.files:
                arrays = mx.load(file)
                mx.eval(list(arrays.values()))
                self._arrays[file] = arrays
        except BaseException as exc:  # the load reads them again and reports it there
            self.error = exc
            self._arrays.clear()
        self.seconds = round(time.perf_counter() - started, 3)

    def arrays(self) -> dict[str, dict[str, Any]]:
        """Each file's arrays by its resolved path, once the thread is done (empty if the
        read failed)."""
        self._thread.join()
        return self._arrays


def wanted(environ: os._Environ[str] | dict[str, str] = os.environ) -> bool:
    """UNIKERN_READ_AHEAD's answer: `1` yes, `0` no, `auto` where CUDA is MLX's default."""
    setting = environ.get(VARIABLE, "auto")
    if setting not in ("auto", "0", "1"):
        from unikern.errors import ConfigError

        raise ConfigError(f"{VARIABLE}={setting!r}: use auto (read ahead where MLX runs on a CUDA GPU), 1 or 0")
    if setting != "auto":
        return setting == "1"
    from unikern.platform import cuda_is_default

    return cuda_is_default()


def start(model_dir: Path) -> ReadAhead | None:
    """Begin reading `model_dir`'s weights unless a read is already under way or it has
    no safetensors files."""
    global _pending
    with _lock:
        if _pending is not None or not (model_dir / "config.json").is_file():
            return None
        ahead = ReadAhead(model_dir)
        if not ahead.files:
            return None
        _pending = ahead
        return ahead


def take() -> ReadAhead | None:
    """The read under way, if any, handed over once (the next call says None): the
    execute stage's load takes it, or drops it when it loads another model."""
    global _pending
    with _lock:
        ahead, _pending = _pending, None
    return ahead


@contextmanager
def serving(ahead: ReadAhead | None, model_dir: Path) -> Iterator[dict[str, float]]:
    """While inside, `mx.load(file)` of a file `ahead` read from `model_dir` returns those
    arrays (each file once); every other load is MLX's own. Waits for the read first,
    so no other MLX work runs beside it. Yields figures for stats.model.startup:
    `read_ahead_s` (the read on its thread) and `read_ahead_files` (the files taken)."""
    import mlx.core as mx

    figures: dict[str, float] = {}
    if ahead is None or ahead.model_dir != model_dir.resolve():
        if ahead is not None:
            ahead.arrays()  # another model: wait it out (nothing else evaluates beside it), drop it
        yield figures
        return
    arrays = dict(ahead.arrays())
    figures["read_ahead_s"] = ahead.seconds or 0.0
    own_load = mx.load
    taken = 0

    def load(file: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal taken
        found = arrays.pop(str(Path(file).resolve()), None) if not args and not kwargs else None
        if found is None:
            return own_load(file, *args, **kwargs)
        taken += 1
        return found

    mx.load = load
    try:
        yield figures
    finally:
        mx.load = own_load
        figures["read_ahead_files"] = taken
