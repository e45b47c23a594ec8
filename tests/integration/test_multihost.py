"""Ranks on several emulated hosts (network namespaces, tests/netns.py; a hostname of their
own, so MOONCAKE_HOST_ID differs by host), rendezvous through ``init_method="tcp://..."``
with no interface hint: every collective and p2p op against independently computed values,
and the clear errors of a data-plane address that cannot work. Skipped where namespaces
cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests import netns
from tests.multihost import rank_hosts, run_ranks
from tests.pg.every_op import expected_collectives

OK, WHY = netns.available()
pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not OK, reason=f"network namespaces: {WHY}"),
]


def _value(x):
    if isinstance(x, dict) and "tensor" in x:
        return torch.tensor(x["tensor"], dtype=getattr(torch, x["dtype"]))
    return x


def _check_every_op(res: dict, world_size: int):
    exp = expected_collectives(world_size)
    for r in range(world_size):
        got = res[r]
        assert "error" not in got, (
            f"rank {r}: {got.get('error')}: {got.get('message')}\n{got.get('tb') or got.get('log')}"
        )
        for k, v in exp[r].items():
            g = _value(got[k])
            if isinstance(v, torch.Tensor):
                assert torch.equal(g, v), f"rank {r}: {k} = {g}, expected {v}"
            else:
                assert g == v, f"rank {r}: {k} = {g!r}, expected {v!r}"


@pytest.mark.parametrize("ranks_per_host", [[2, 2], [3, 1]], ids=["2x2", "3+1"])
def test_tcp_init_method_across_hosts_needs_no_interface_hint(ranks_per_host):
    """init_method="tcp://<host 0>:PORT", no MASTER_ADDR, no MOONCAKE_SOCKET_IFNAME, no
    host_ip: the data plane listens on the interface routed to the store's host (ranks on
    host 0 reach the store over loopback and still advertise the bridge address)."""
    with netns.hosts(len(ranks_per_host), "mcmh") as t:
        res = run_ranks(t, ranks_per_host, "every_op", timeout_s=150)
    _check_every_op(res, len(rank_hosts(ranks_per_host)))


@pytest.mark.parametrize(
    "host_ip, expect",
    [
        ("10.99.0.7", "cannot listen on 10.99.0.7"),  # not an address of this host
        ("127.0.0.1", "listens on the loopback address 127.0.0.1"),  # unreachable from host 1
    ],
    ids=["not-local", "loopback"],
)
def test_a_data_plane_address_that_cannot_work_raises_on_every_rank(host_ip, expect):
    """Rank 1 (host 0) is given a host_ip the other host cannot use: every rank raises at
    init_process_group, naming rank 1 and the fix, instead of a connection refused or a
    timeout in the first op."""
    with netns.hosts(2, "mcmh") as t:
        res = run_ranks(
            t,
            [2, 2],
            "every_op",
            rank_env={1: {"MH_OPTIONS": json.dumps({"host_ip": host_ip})}},
            timeout_s=150,
        )
    for r in range(4):
        got = res[r]
        assert got.get("error") in ("RuntimeError", "DistBackendError", "ValueError"), (r, got)
        assert expect in got["message"] and "rank 1" in got["message"], (r, got["message"])
        assert "host_ip" in got["message"] and "MOONCAKE_SOCKET_IFNAME" in got["message"], got[
            "message"
        ]
