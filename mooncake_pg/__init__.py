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


def backend_of(group=None):
    """The ``mooncake`` backend object of ``group`` (default: the default group).

    Exposes ``transport`` (``"shm"`` or ``"tcp"``) and ``ops_issued``. Raises
    ``ValueError`` if the group's CPU backend is not ``mooncake``.
    """
    import torch as _torch

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    be = pg._get_backend(_torch.device("cpu"))
    if not isinstance(be, _C.MooncakeBackend):
        raise ValueError(f"backend_of: the group's CPU backend is {type(be).__name__}, not mooncake")
    return be


__all__.append("backend_of")
