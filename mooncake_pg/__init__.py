"""``mooncake_pg``: the ``"mooncake"`` backend for ``torch.distributed``.

Importing this package registers the backend::

    import torch.distributed as dist
    import mooncake_pg
    dist.init_process_group("mooncake", rank=r, world_size=w, init_method=...)

Options go in ``pg_options=MooncakeOptions(...)``; groups made without options
(``new_group``, DeviceMesh) inherit the default group's options.
"""
from __future__ import annotations

import torch  # noqa: F401  (must be imported before the extension)
import torch.distributed as dist

from ._loader import load_extension
from .config import MooncakeOptions, env_defaults, resolve

_C = load_extension()

__all__ = ["MooncakeOptions", "env_defaults", "BACKEND_NAME"]

BACKEND_NAME = "mooncake"

from ._backend import _create_backend, _register  # noqa: E402

_register()
