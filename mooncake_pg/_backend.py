"""The creator torch.distributed calls for each ``mooncake`` group."""
from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist

from . import _C
from .config import MooncakeOptions, resolve
from .transport_addr import listen_address

_default_options: Optional[MooncakeOptions] = None


def _create_backend(dist_opts, pg_options):
    """Called by torch with ``(_DistributedBackendOptions, pg_options | None)``.

    Groups made without options (``new_group``, DeviceMesh) inherit the options of the
    first group that was created with them (the default group).
    """
    global _default_options
    if pg_options is not None and not isinstance(pg_options, MooncakeOptions):
        raise TypeError(
            f"mooncake: pg_options must be mooncake_pg.MooncakeOptions, got {type(pg_options).__name__}")
    if pg_options is None:
        pg_options = _default_options
    elif _default_options is None:
        _default_options = pg_options
    settings = resolve(pg_options)
    if settings["max_group_size"] not in (None, dist_opts.group_size):
        raise NotImplementedError(
            "mooncake: max_group_size different from the world size (extension seats) is not "
            "supported yet")

    global_ranks = list(getattr(dist_opts, "global_ranks_in_group", None) or [])
    dead = sorted(set(_C.known_failed_global_ranks()) & set(global_ranks or range(dist_opts.group_size)))
    if dead:
        from .errors import RankFailureError

        raise RankFailureError(
            f"mooncake: cannot create a group containing rank(s) {dead}: they were agreed failed "
            "(recover them before creating groups that include them)", dead, 0)
    cfg = _C.BackendConfig()
    if global_ranks:
        cfg.global_ranks = global_ranks
    cfg.timeout_s = settings["timeout"]
    cfg.transport = settings["transport"]
    cfg.host_id = settings["host_id"]
    cfg.listen_host = listen_address(settings["host_ip"], settings["socket_ifname"])
    cfg.shm_slot_bytes = int(settings["shm_slot_bytes"])
    cfg.debug = settings["debug"]
    cfg.group_name = str(getattr(dist_opts, "group_id", ""))
    cfg.on_failure = settings["on_failure"]
    cfg.is_recovery = bool(settings["is_recovery"])
    if settings["fault_inject"]:
        op, _, rnd = settings["fault_inject"].partition(":")
        cfg.inject_kill_op, cfg.inject_kill_round = int(op), int(rnd or 0)
    return _C.MooncakeBackend(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, cfg)


def _register():
    if "mooncake" in dist.Backend.backend_list:
        return
    dist.Backend.register_backend("mooncake", _create_backend, extended_api=True, devices=["cpu"])
