"""The one place that loads the private extension ``mooncake_pg._C``.

Every module of the package takes the extension from here (``from ._loader import _C``),
so the torch version it was built for is checked before anything of it is used.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch


def _load() -> ModuleType:
    """Imports ``mooncake_pg._C`` after checking it was built for the running torch.

    Raises:
        ImportError: the extension is not built, or was built for another torch version
            (the message names both versions and the command that rebuilds it).
    """
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


_C = _load()
