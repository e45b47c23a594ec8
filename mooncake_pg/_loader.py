"""Loads the private extension ``mooncake_pg._C`` after checking the torch version."""

from __future__ import annotations

import importlib

import torch


def load_extension():
    try:
        from . import _build_info
    except ImportError as e:  # pragma: no cover - only on a broken install
        raise ImportError(
            "mooncake_pg: the C++ extension is not built; run "
            "`pip install --no-build-isolation -e .` in the project root"
        ) from e
    built = _build_info.TORCH_VERSION
    if built != torch.__version__:
        raise ImportError(
            f"mooncake_pg._C was built for torch {built} but torch {torch.__version__} is "
            "running; rebuild with `pip install --no-build-isolation -e .`"
        )
    return importlib.import_module("mooncake_pg._C")
