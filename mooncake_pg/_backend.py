"""The creator torch.distributed calls for each ``mooncake`` group."""

from __future__ import annotations

import functools

import torch.distributed as dist

from ._loader import _C
from .config import MooncakeOptions, resolve
from .transport_addr import listen_address, rendezvous_address

_default_options: MooncakeOptions | None = None
_pending_second = None  # (group prefix store, backend) awaiting the creator's call for "cuda"


def _create_backend(dist_opts, pg_options):
    """Called by torch with ``(_DistributedBackendOptions, pg_options | None)``.

    Groups made without options (``new_group``, DeviceMesh) inherit the options of the
    first group that was created with them (the default group).
    """
    global _default_options, _pending_second
    # Registered for "cpu" and "cuda", torch calls the creator once per device, in a row,
    # with stores under the same group prefix: both devices share one backend (one
    # membership, one transport). Only that second call is answered from here, and the
    # reference is dropped then, so a destroyed group's backend is not kept alive.
    group_store = getattr(dist_opts.store, "underlying_store", None)
    if _pending_second is not None:
        pending, _pending_second = _pending_second, None
        if group_store is not None and pending[0] is group_store:
            return pending[1]
    if pg_options is not None and not isinstance(pg_options, MooncakeOptions):
        raise TypeError(
            f"mooncake: pg_options must be mooncake_pg.MooncakeOptions, got {type(pg_options).__name__}"
        )
    is_default = not dist.is_initialized()  # the default group is created before it is registered
    explicit = pg_options is not None
    if pg_options is None:
        pg_options = _default_options
    elif _default_options is None:
        _default_options = pg_options
    settings = resolve(pg_options)
    global_ranks = list(getattr(dist_opts, "global_ranks_in_group", None) or [])
    initial_active = []
    if is_default:
        if settings["max_group_size"] not in (None, dist_opts.group_size):
            raise ValueError(
                f"mooncake: max_group_size ({settings['max_group_size']}) must equal the world size given "
                f"to init_process_group ({dist_opts.group_size}); extension seats are seats of the world "
                "that are not in active_ranks"
            )
        is_recovery = settings["is_recovery"]
        if settings["active_ranks"] is not None:
            initial_active = list(settings["active_ranks"])
            if initial_active[-1] >= dist_opts.group_size:
                raise ValueError(
                    f"mooncake: active_ranks {initial_active} must lie in [0, world_size="
                    f"{dist_opts.group_size})"
                )
    else:
        default_be = _default_backend()
        if explicit and pg_options.is_recovery is not None:
            is_recovery = bool(pg_options.is_recovery)
        else:
            # re-created while the default group still waits to join: joined the same way
            is_recovery = bool(default_be is not None and default_be.joining)
        if default_be is not None and not is_recovery:
            mask = default_be.active_ranks()
            members = global_ranks or list(range(dist_opts.group_size))
            initial_active = [j for j, g in enumerate(members) if g < len(mask) and mask[g]]
            if len(initial_active) == dist_opts.group_size:
                initial_active = []

    dead = sorted(
        set(_C.known_failed_global_ranks()) & set(global_ranks or range(dist_opts.group_size))
    )
    if dead:
        from .errors import RankFailureError

        raise RankFailureError(
            f"mooncake: cannot create a group containing rank(s) {dead}: they were agreed failed "
            "(recover them before creating groups that include them)",
            dead,
            0,
        )
    cfg = _C.BackendConfig()
    if global_ranks:
        cfg.global_ranks = global_ranks
    cfg.timeout_s = settings["timeout"]
    cfg.transport = settings["transport"]
    cfg.host_id = settings["host_id"]
    cfg.rendezvous_addr = rendezvous_address(dist_opts.store)
    cfg.listen_host, cfg.listen_host_explicit = listen_address(
        settings["host_ip"], settings["socket_ifname"], cfg.rendezvous_addr
    )
    cfg.shm_slot_bytes = int(settings["shm_slot_bytes"])
    cfg.debug = settings["debug"]
    cfg.group_name = str(getattr(dist_opts, "group_id", ""))
    cfg.on_failure = settings["on_failure"]
    cfg.is_recovery = is_recovery
    cfg.rdma_device = settings["rdma_device"]
    cfg.rdma_gid_index = int(settings["rdma_gid_index"])
    cfg.initial_active = initial_active
    cfg.cuda_ipc = bool(settings["cuda_ipc"])
    cfg.hierarchical = bool(settings["hierarchical"])
    if settings["fault_inject"]:
        op, _, rnd = settings["fault_inject"].partition(":")
        cfg.inject_kill_op, cfg.inject_kill_round = int(op), int(rnd or 0)
    if settings["fault_delay"]:
        try:
            op, peer, ms = (int(v) for v in settings["fault_delay"].split(":"))
        except ValueError:
            raise ValueError(
                f"MOONCAKE_FAULT_DELAY must be OP:PEER:MS (integers), got {settings['fault_delay']!r}"
            ) from None
        cfg.inject_delay_op, cfg.inject_delay_peer, cfg.inject_delay_ms = op, peer, ms
    be = _C.MooncakeBackend(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, cfg)
    if getattr(_C, "WITH_CUDA", False) and group_store is not None:
        _pending_second = (group_store, be)
    return be


def _default_backend():
    """The default group's ``mooncake`` backend, or ``None``."""
    import torch

    if not dist.is_initialized():
        return None
    be = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return be if isinstance(be, _C.MooncakeBackend) else None


def _register():
    if "mooncake" in dist.Backend.backend_list:
        return
    # CUDA tensors only when the extension was built with CUDA (pinned host staging and
    # CUDA kernels); a CPU-only build serves CPU tensors only.
    devices = ["cpu", "cuda"] if getattr(_C, "WITH_CUDA", False) else ["cpu"]
    dist.Backend.register_backend("mooncake", _create_backend, extended_api=True, devices=devices)
    _register_shrunk_groups_as_custom()
    _exclude_global_ranks_when_shrinking_subgroups()


def _exclude_global_ranks_when_shrinking_subgroups():
    """Makes torch 2.13's ``shrink_group`` exclude a ``mooncake`` subgroup's ranks as global ranks.

    torch 2.13's ``shrink_group(ranks_to_exclude, group)`` takes group ranks, but
    ``_finalize_shrunk_group`` filters the group's *global* ranks with them when it records the new
    group's members; for a subgroup (not the default group) that keeps the wrong ranks, so
    ``get_rank``/``get_process_group_ranks`` and rooted ops of the shrunk group address the wrong
    processes. For a ``mooncake`` subgroup the excluded ranks are handed over as global ranks (the
    backend was already shrunk with the group ranks).
    """
    c10d = dist.distributed_c10d
    finalize = getattr(c10d, "_finalize_shrunk_group", None)
    if finalize is None or getattr(finalize, "_mooncake_global", False):
        return

    @functools.wraps(finalize)
    def finalize_shrunk_group(group_info, excluded_ranks_set, new_backend, *args, **kwargs):
        pg = group_info.get("process_group") if isinstance(group_info, dict) else None
        if (
            pg is not None
            and not group_info.get("is_default_group", True)
            and isinstance(new_backend, _C.MooncakeBackend)
        ):
            excluded_ranks_set = {c10d.get_global_rank(pg, r) for r in excluded_ranks_set}
        return finalize(group_info, excluded_ranks_set, new_backend, *args, **kwargs)

    finalize_shrunk_group._mooncake_global = True
    c10d._finalize_shrunk_group = finalize_shrunk_group


def _register_shrunk_groups_as_custom():
    """Registers our backend again as ``CUSTOM`` in the groups torch 2.13's ``shrink_group`` makes.

    torch 2.13's ``shrink_group`` registers the new group's backend under ``BackendType.GLOO``
    (``NCCL`` on CUDA) whatever the backend is; DDP's logger then treats a "gloo" group's backend as
    ``ProcessGroupGloo`` (a static cast) and crashes on ours. The group
    ``_create_shrunk_process_group`` returns gets our backend registered again as ``CUSTOM`` (as
    ``init_process_group`` / ``new_group`` register it).
    """
    c10d = dist.distributed_c10d
    make = getattr(c10d, "_create_shrunk_process_group", None)
    if make is None or getattr(make, "_mooncake_custom", False):
        return

    @functools.wraps(make)
    def create_shrunk_process_group(*args, **kwargs):
        import torch

        pg = make(*args, **kwargs)
        custom = dist.ProcessGroup.BackendType.CUSTOM
        for dev in ("cpu", "cuda"):
            try:
                be = pg._get_backend(torch.device(dev))
            except RuntimeError:  # no backend for that device
                continue
            if isinstance(be, _C.MooncakeBackend):
                pg._register_backend(torch.device(dev), custom, be)
                pg._set_default_backend(custom)
        return pg

    create_shrunk_process_group._mooncake_custom = True
    c10d._create_shrunk_process_group = create_shrunk_process_group
