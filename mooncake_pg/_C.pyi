"""Type stub of ``mooncake_pg._C``, the private extension.

``csrc/bindings/`` has one register function per part; ``module.cpp`` calls them.
``tests/pg/test_build.py`` checks that the names here are the names the built module exports.

The ``_rdma_*`` helpers exist only in a build with RDMA; the ``_cuda_*`` helpers raise
``RuntimeError`` in a build without CUDA (``WITH_CUDA`` is ``False``).
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch._C._distributed_c10d import Backend, Store
from torch.distributed.distributed_c10d import Work
from typing_extensions import Buffer

TORCH_VERSION: str
WITH_CUDA: bool
WITH_RDMA: bool

# ---- process group (bindings/pg.cpp) ----

class BackendConfig:
    """The settings of one group.

    mooncake_pg/_backend.py fills it from MooncakeOptions and the environment; csrc/core/group.hpp
    documents each field.
    """

    timeout_s: float
    transport: str
    host_id: str
    listen_host: str
    listen_host_explicit: bool
    rendezvous_addr: str
    shm_slot_bytes: int
    p2p_ring_bytes: int
    debug: bool
    group_name: str
    on_failure: str
    inject_kill_op: int
    inject_kill_round: int
    inject_delay_op: int
    inject_delay_peer: int
    inject_delay_ms: int
    global_ranks: list[int]
    initial_active: list[int]
    is_recovery: bool
    rdma_device: str
    rdma_gid_index: int
    cuda_ipc: bool
    hierarchical: bool
    def __init__(self) -> None: ...

class MooncakeWork(Work):
    @property
    def failed_ranks(self) -> list[int]:
        """The ranks whose failure ended the op (empty unless it raised RankFailureError)."""

class MooncakeBackend(Backend):
    def __init__(self, store: Store, rank: int, size: int, config: BackendConfig) -> None: ...
    @property
    def transport(self) -> str: ...
    @property
    def ops_issued(self) -> int: ...
    def _cuda_ipc_status(self) -> str: ...
    def rank_hosts(self) -> list[int]: ...
    def active_ranks(self) -> list[int]: ...
    def epoch(self) -> int: ...
    def failed_ranks(self) -> list[int]: ...
    def pending_failed(self) -> list[int]: ...
    def deactivate_ranks(self, ranks: Sequence[int]) -> None: ...
    def pending_ranks(self) -> list[int]: ...
    def recover_ranks(self, ranks: Sequence[int]) -> None: ...
    def join_group(self, timeout_s: float) -> None: ...
    @property
    def joining(self) -> bool: ...
    def last_joined(self) -> list[int]: ...

def known_failed_global_ranks() -> list[int]:
    """Default-group ranks that any mooncake group of this process has agreed failed."""

def _cuda_reduce(dst: torch.Tensor, srcs: Sequence[torch.Tensor], op: int) -> None: ...
def _cuda_ipc_export(tensor: torch.Tensor) -> tuple[bytes, int]: ...
def _cuda_ipc_reduce_from(dst: torch.Tensor, handle: bytes, offset: int, op: int) -> None: ...

# ---- expert parallel (bindings/ep.cpp) ----

def _ep_scatter_add_rows(
    rows: torch.Tensor,
    idx: torch.Tensor,
    src: torch.Tensor | None,
    weights: torch.Tensor | None,
    out: torch.Tensor,
) -> None: ...

# ---- transfer engine and helpers (bindings/transport.cpp) ----

class TransferEngine:
    def __init__(self, listen_host: str, secret: str = "") -> None: ...
    @property
    def port(self) -> int: ...
    @property
    def host(self) -> str: ...
    def register_memory(self, buffer: Buffer) -> int: ...
    def unregister_memory(self, region: int) -> None: ...
    def batch_write(
        self, host: str, port: int, region: int, offsets: Sequence[int], buffers: Sequence[Buffer]
    ) -> None: ...
    def batch_read(
        self, host: str, port: int, region: int, offsets: Sequence[int], buffers: Sequence[Buffer]
    ) -> None: ...
    def batch_read_bytes(
        self, host: str, port: int, region: int, offsets: Sequence[int], lens: Sequence[int]
    ) -> list[bytes]: ...
    def close(self) -> None: ...

def copy_buffers(dsts: Sequence[Buffer], srcs: Sequence[Buffer], threads: int) -> None: ...
def copy_to_bytes(srcs: Sequence[Buffer], threads: int) -> list[bytes]: ...
def touch_pages(buffer: Buffer) -> int: ...
def local_address_for(peer: str, ifname: str, /) -> str: ...
def available_cpus() -> int: ...
def rdma_devices() -> list[dict[str, Any]]: ...
def _rdma_choose(devices: Sequence[dict[str, Any]], spec: str) -> tuple[str, int]: ...
def _rdma_qp_info_roundtrip(info: str, /) -> str: ...
