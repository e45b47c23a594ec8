"""What this build and this machine offer beyond the CPU: RDMA NICs and CUDA.

``WITH_RDMA`` / ``WITH_CUDA`` say whether the extension was compiled with the RDMA
transport (``infiniband/verbs.h`` present at build time) and the CUDA parts
(``MOONCAKE_WITH_CUDA=1``). :func:`rdma_devices` lists the NICs the verbs library sees.
"""

from __future__ import annotations

import dataclasses

from ._loader import _C

WITH_RDMA: bool = bool(getattr(_C, "WITH_RDMA", False))
WITH_CUDA: bool = bool(getattr(_C, "WITH_CUDA", False))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RdmaPort:
    """One port of an RDMA device.

    Attributes:
        port: 1-based port number.
        state: ``ibv_port_state_str`` of the port, e.g. ``"PORT_ACTIVE"``, ``"PORT_DOWN"``.
        active: ``state == "PORT_ACTIVE"`` (only active ports carry traffic).
        link_layer: ``"InfiniBand"`` or ``"Ethernet"`` (RoCE).
        lid: local identifier (InfiniBand; 0 on RoCE).
        active_mtu: path MTU in bytes (256..4096).
        gid_index: the GID index ``transport="rdma"`` uses on this port by default (-1: none).
        gid: that GID as eight groups of four hex digits (``""`` when none).
    """

    port: int
    state: str
    active: bool
    link_layer: str
    lid: int
    active_mtu: int
    gid_index: int
    gid: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class RdmaDevice:
    """An RDMA device (NIC) as the verbs library names it, with its ports.

    Attributes:
        name: device name, e.g. ``"mlx5_0"`` (what ``MOONCAKE_RDMA_DEVICE`` takes).
        node_guid: node GUID, 16 hex digits.
        ports: its ports (empty when the device could not be opened).
    """

    name: str
    node_guid: str
    ports: tuple[RdmaPort, ...]


def rdma_devices() -> list[RdmaDevice]:
    """RDMA devices visible through libibverbs.

    Found with ``ibv_get_device_list``, ``ibv_query_port`` and ``ibv_query_gid``. Returns ``[]``
    on a machine without RDMA devices and on a build without the RDMA transport (see
    ``WITH_RDMA``); never raises for a missing device.
    """
    out = []
    for d in _C.rdma_devices():
        ports = tuple(RdmaPort(**p) for p in d["ports"])
        out.append(RdmaDevice(name=d["name"], node_guid=d["node_guid"], ports=ports))
    return out
