"""Where models come from: the embedded default, a local directory, or a hub repo."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from unikern.errors import ConfigError

DEFAULT_MODEL = "default"


def default_model_path() -> Path:
    return Path(str(resources.files("unikern.assets").joinpath("default_model")))


def resolve_model_path(model: str) -> Path:
    """`default` -> the embedded model; a directory -> itself; else a hub repo id
    fetched by mlx-lm (which needs network)."""
    if model == DEFAULT_MODEL:
        path = default_model_path()
        if not (path / "config.json").is_file():
            raise ConfigError(f"the embedded default model is missing at {path}")
        return path
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model directory {path} has no config.json")
        return path
    if model.count("/") != 1:
        raise ConfigError(
            f"model {model!r} is neither a local directory nor a hub repo id like 'org/name'"
        )
    from mlx_lm.utils import _download  # the same resolution mlx_lm.load uses

    try:
        return _download(model)
    except Exception as exc:  # network, auth, missing repo: say which model and why
        raise ConfigError(f"could not fetch model {model!r}: {exc}") from exc
