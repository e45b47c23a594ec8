"""Ranks on several emulated hosts (network namespaces, tests/netns.py; a hostname of their
own, so MOONCAKE_HOST_ID differs by host), rendezvous through ``init_method="tcp://..."``
with no interface hint: every collective and p2p op against independently computed values,
and the clear errors of a data-plane address that cannot work. Skipped where namespaces
cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from tests import netns
from tests.multihost import rank_hosts, run_ranks, start_ranks
from tests.pg.every_op import assert_collectives, expected_collectives, expected_sweep

OK, WHY = netns.available()
pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not OK, reason=f"network namespaces: {WHY}"),
]


def _decoded(got: dict) -> dict:
    """A rank's JSON result with its tensors rebuilt (tests/multihost_rank.py's encoding)."""
    return {
        k: torch.tensor(v["tensor"], dtype=getattr(torch, v["dtype"]))
        if isinstance(v, dict) and "tensor" in v
        else v
        for k, v in got.items()
    }


def _no_error(res: dict, r: int):
    got = res[r]
    assert "error" not in got, (
        f"rank {r}: {got.get('error')}: {got.get('message')}\n{got.get('tb') or got.get('log')}"
    )


def _check_every_op(res: dict, world_size: int):
    exp = expected_collectives(world_size)
    for r in range(world_size):
        _no_error(res, r)
        assert_collectives(_decoded(res[r]), exp[r], f"rank {r}")


@pytest.mark.slow
@pytest.mark.parametrize("ranks_per_host", [[2, 2], [3, 1]], ids=["2x2", "3+1"])
def test_tcp_init_method_across_hosts_needs_no_interface_hint(ranks_per_host):
    """init_method="tcp://<host 0>:PORT", no MASTER_ADDR, no MOONCAKE_SOCKET_IFNAME, no
    host_ip: the data plane listens on the interface routed to the store's host (ranks on
    host 0 reach the store over loopback and still advertise the bridge address)."""
    with netns.hosts(len(ranks_per_host), "mcmh") as t:
        res = run_ranks(t, ranks_per_host, "every_op", timeout_s=150)
    _check_every_op(res, len(rank_hosts(ranks_per_host)))


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_failure_policy_that_differs_raises_on_every_rank():
    """Rank 3 asks for on_failure="mask", the others for "raise": a rank that dies would
    leave the two sides with different members and results, so every rank's
    init_process_group raises ValueError naming on_failure and a rank that differs."""
    with netns.hosts(2, "mcmh") as t:
        res = run_ranks(
            t,
            [2, 2],
            "every_op",
            rank_env={3: {"MH_OPTIONS": json.dumps({"on_failure": "mask"})}},
            timeout_s=150,
        )
    for r in range(4):
        got = res[r]
        assert got.get("error") == "ValueError", (r, got)
        assert "on_failure" in got["message"] and "rank 3" in got["message"], (r, got["message"])


@pytest.mark.slow(unless={"ranks_per_host": [[2, 2]]})
@pytest.mark.parametrize(
    "ranks_per_host", [[2, 2], [3, 1], [2, 2, 2, 2]], ids=["2x2", "3+1", "4x2"]
)
def test_every_collective_across_hosts(ranks_per_host):
    """Every collective and p2p op, and all_reduce / all_gather / reduce_scatter / broadcast /
    all_to_all (uneven splits) in one dtype of each class, a non-contiguous and a zero-element
    all_reduce: on the default group, on a subgroup spanning hosts and on one inside host 0,
    against values computed here."""
    with netns.hosts(len(ranks_per_host), "mcmh") as t:
        res = run_ranks(t, ranks_per_host, "conformance", timeout_s=200)
    n = sum(ranks_per_host)
    for r in range(n):
        _no_error(res, r)
    groups = {
        "world": list(range(n)),
        "spanning": [0, n - 1],
        "inside": list(range(ranks_per_host[0])),
    }
    for name, members in groups.items():
        exp_ops = expected_collectives(len(members))
        exp_sweep = expected_sweep(len(members))
        for i, g in enumerate(members):
            assert_collectives(
                _decoded(res[g][name]),
                {**exp_ops[i], **exp_sweep[i]},
                f"{name} rank {i} (global {g})",
            )


@pytest.mark.slow
def test_a_silent_host_is_agreed_failed_within_seconds(tmp_path):
    """Host 1 (ranks 2, 3) is cut off while the four ranks all_reduce in a loop with the
    default op timeout (30 s) and on_failure="mask": the link drops every frame (no RST, no
    FIN), so only the heartbeats between hosts can tell. Host 0's ranks agree that 2 and 3
    failed and go on within 3 s of the cut (the longest op, which includes detection and
    agreement, stays under 3 s; the op timeout would take 30)."""
    progress = tmp_path / "progress"
    progress.mkdir()
    with netns.hosts(2, "mcmh") as t:
        ranks = start_ranks(
            t,
            [2, 2],
            "until_host_lost",
            {
                "survivors_sum": 1.0 + 2.0,
                "progress_dir": str(progress),
                "options": {"on_failure": "mask"},
            },
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            done = [int((progress / f).read_text() or 0) for f in os.listdir(progress)]
            if len(done) == 4 and min(done) >= 5:
                break
            time.sleep(0.05)
        else:
            res = ranks.results(1)
            raise AssertionError(f"the ranks did not get going: {res}")
        netns.cut(t, t.hosts[1])
        t_cut = time.monotonic()
        res = ranks.results(60, ranks=[0, 1])
        took = time.monotonic() - t_cut
    for r in (0, 1):
        got = res[r]
        assert "error" not in got, f"rank {r}: {got}"
        assert got["active"] == [1, 1, 0, 0] and got["epoch"] in (1, 2), got
        assert got["longest_op_s"] < 3.0, (got, took)
    print(f"cut agreed: longest op {res[0]['longest_op_s']:.2f} / {res[1]['longest_op_s']:.2f} s")


@pytest.mark.slow
def test_a_rank_busy_between_ops_is_not_blamed():
    """Rank 3 (host 1) computes for 20 s between two all_reduces while the others already
    wait inside the second (op timeout 30 s): its heartbeats go on, nobody is declared
    failed, the result is right."""
    with netns.hosts(2, "mcmh") as t:
        res = run_ranks(
            t, [2, 2], "busy_between_ops", {"busy_rank": 3, "busy_s": 20.0}, timeout_s=120
        )
    for r in range(4):
        got = res[r]
        assert "error" not in got, f"rank {r}: {got}"
        assert got["first"] == got["second"] == 10.0, got
        assert got["active"] == [1, 1, 1, 1] and got["epoch"] == 0, got
        if r != 3:
            assert got["waited_s"] > 15.0, got  # they did wait for rank 3


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mask", "raise"])
def test_a_host_later_than_the_timeout_is_fenced_not_given_a_result(policy):
    """Both ranks of host 0 enter an all_reduce 8 s after the others (op timeout 4 s). The
    others declare them failed: under "mask" they return the sum over host 1, under "raise"
    they raise RankFailureError. The late ranks find the frames host 1 sent before it gave
    up in their sockets, yet must not return the sum of all four: they raise
    RankFencedError, and so does their next op."""
    with netns.hosts(2, "mcmh") as t:
        res = run_ranks(
            t,
            [2, 2],
            "late_host",
            {
                "late_ranks": [0, 1],
                "late_s": 8.0,
                "options": {"timeout": 4.0, "on_failure": policy},
            },
            timeout_s=120,
        )
    for r in (0, 1):
        assert res[r].get("errors") == ["RankFencedError"] * 2, (r, res[r])
    for r in (2, 3):
        got = res[r]
        if policy == "mask":
            assert "error" not in got, (r, got)
            assert got["first"] == 10.0 and got["second"] == 3.0 + 4.0, (r, got)
            assert got["active"] == [0, 0, 1, 1] and got["epoch"] == 1, (r, got)
        else:
            assert got.get("error") == "RankFailureError", (r, got)


@pytest.mark.slow
@pytest.mark.parametrize(
    "ranks_per_host, options, counts",
    [
        ([2, 2], {}, [5003, 300007]),
        ([2, 2], {"shm_slot_bytes": 8192}, [4099, 20011]),
        ([2, 2, 2, 2], {"shm_slot_bytes": 8192}, [4099, 20011]),
        ([3, 1], {"shm_slot_bytes": 8192}, [4099, 70001]),
        ([1, 2, 2], {"shm_slot_bytes": 8192}, [4099, 70001]),
        ([2, 2, 2, 2], {}, [5003, 40009, 70001]),
        ([1, 2, 2], {}, [5003, 40009, 70001]),
        ([2, 2, 2, 2], {"transport": "tcp"}, [40009]),
    ],
    ids=[
        "2x2",
        "2x2-small-slot",
        "4x2-small-slot",
        "3+1-small-slot",
        "1+2+2-small-slot",
        "4x2",
        "1+2+2",
        "4x2-tcp",
    ],
)
def test_large_messages_across_hosts_match_torch(ranks_per_host, options, counts):
    """The two-level collectives (all_reduce, reduce, reduce_scatter, all_gather, broadcast;
    uniform hosts; broadcast also on uneven ones) and the flat ones (3+1) at sizes above the
    one-round path, in one piece (broadcast's star, also under transport "tcp", where a
    host's ranks reach each other over TCP) and in pieces ending mid-stripe (a small shm_slot_bytes cuts them into
    many: broadcast's chain): float, integer, bfloat16/float16, uint8 and bool with SUM, AVG,
    MAX and PREMUL_SUM, roots on every host, each result equal to torch's reduction of every
    rank's input."""
    with netns.hosts(len(ranks_per_host), "mcmh") as t:
        res = run_ranks(
            t, ranks_per_host, "large_ops", {"counts": counts, "options": options}, timeout_s=200
        )
    for r in range(sum(ranks_per_host)):
        _no_error(res, r)
        assert res[r]["checked"] and res[r]["bad"] == {}, (r, res[r]["bad"])


@pytest.mark.slow
@pytest.mark.parametrize("ranks_per_host", [[2, 2], [2, 2, 2, 2]], ids=["2x2", "4x2"])
def test_each_host_link_carries_one_copy_per_remote_host(ranks_per_host):
    """Bytes that leave each host (its eth0) in one 4 MiB all_reduce, reduce_scatter_tensor,
    all_gather_into_tensor and broadcast stay within 15% (frame headers, ACKs) of the link
    bound: what must leave the busiest host (benchmarks/multihost_bench.py); sending to
    every remote rank instead of every remote host would double it at 2 ranks per host."""
    S = 4 << 20
    with netns.hosts(len(ranks_per_host), "mcmh") as t:
        res = run_ranks(t, ranks_per_host, "bytes_out", {"nbytes": S}, timeout_s=150)
    H, G = len(ranks_per_host), ranks_per_host[0]
    bound = {
        "all_reduce": 2 * (H - 1) / H * S,
        "reduce_scatter_tensor": (H - 1) / H * S,
        "all_gather_into_tensor": G * (H - 1) * S,
        "broadcast": S,
    }
    for h in range(H):
        for r in range(h * G, (h + 1) * G):
            _no_error(res, r)
        for op, b in bound.items():
            # each of the host's ranks read the host's counter around the op; the least
            # is the tightest window (another's may include a straggler of the barrier)
            sent = min(res[r][op] for r in range(h * G, (h + 1) * G))
            assert sent <= 1.15 * b + (64 << 10), (
                f"host {h}: {op} sent {sent / 2**20:.2f} MiB, bound {b / 2**20:.2f} MiB"
            )


@pytest.mark.slow
def test_broadcast_from_a_lone_trainer_host_sends_one_copy_per_link():
    """Weight sync's shape: the root alone on its host, three hosts of two readers. A 4 MiB
    broadcast goes along the chain of hosts, each host's first rank passing it on and its
    mate reading it in place: every host sends at most one copy (the last none), where
    rank to rank the root's link would carry six."""
    S = 4 << 20
    with netns.hosts(4, "mcmh") as t:
        res = run_ranks(
            t,
            [1, 2, 2, 2],
            "bytes_out",
            {"nbytes": S, "ops": ["broadcast"], "broadcast_src": 0},
            timeout_s=150,
        )
    for r in range(7):
        _no_error(res, r)
    for h, ranks in enumerate([[0], [1, 2], [3, 4], [5, 6]]):
        sent = min(res[r]["broadcast"] for r in ranks)
        assert sent <= 1.15 * S + (64 << 10), f"host {h}: sent {sent / 2**20:.2f} MiB"


@pytest.mark.slow
@pytest.mark.parametrize("ranks_per_host", [[2, 2], [3, 1]], ids=["2x2", "3+1"])
def test_rank_hosts_and_the_per_host_token_counts_of_ep(ranks_per_host):
    """mooncake_pg.get_rank_hosts gives each rank's host on every rank; mooncake_ep's
    get_dispatch_layout counts the tokens that go to each host (once per host, however many
    of its ranks or experts they reach) under DeepEP's name num_tokens_per_rdma_rank,
    against a count made here from the routing and the host map."""
    W, E = sum(ranks_per_host), 16
    L = E // W
    idx = [[0, 1, -1], [0, E - 1, 5], [-1, -1, -1], [E - 1, E - 2, E - 1], [4, 9, 13], [7, 7, 8]]
    hosts = rank_hosts(ranks_per_host)
    with netns.hosts(len(ranks_per_host), "mcmh") as t:
        res = run_ranks(
            t, ranks_per_host, "ep_layout", {"topk_idx": idx, "num_experts": E}, timeout_s=120
        )
    want_hosts = [0] * len(ranks_per_host)
    for row in idx:
        for h in {hosts[e // L] for e in row if e >= 0}:
            want_hosts[h] += 1
    want_ranks = [sum(any(e >= 0 and e // L == r for e in row) for row in idx) for r in range(W)]
    for r in range(W):
        _no_error(res, r)
        assert res[r]["rank_hosts"] == hosts, res[r]
        lay = res[r]["layout"]
        assert lay["num_tokens_per_rdma_rank"] == want_hosts, lay
        assert lay["num_tokens_per_rank"] == want_ranks, lay


@pytest.mark.slow(unless={"policy": ["raise"]})
@pytest.mark.parametrize("policy", ["mask", "raise"])
def test_sigkill_on_another_host_mid_all_reduce(policy):
    """Rank 3 (host 1) SIGKILLs itself in the middle of the pipeline of its fourth 1 MiB
    all_reduce (two levels: shared memory inside a host, TCP between hosts). mask: every
    survivor gets 1 + 2 + 3 from that op on (the rerun over the survivors, now uneven hosts
    and the flat schedule), 10 before; raise: every survivor raises at the same op."""
    with netns.hosts(2, "mcmh") as t:
        res = run_ranks(
            t,
            [2, 2],
            "loop_all_reduce",
            {"ops": 8, "count": 1 << 18, "options": {"on_failure": policy}},
            rank_env={3: {"MOONCAKE_FAULT_INJECT": "3:2"}},
            timeout_s=150,
        )
    assert "error" in res[3] or "results" not in res[3], res[3]  # it died
    survivors = [res[r] for r in (0, 1, 2)]
    for r, got in enumerate(survivors):
        assert "results" in got, (r, got)
    seqs = [got["results"] for got in survivors]
    assert seqs[0] == seqs[1] == seqs[2], seqs
    seq = seqs[0]
    assert seq[:3] == [10.0, 10.0, 10.0], seq
    if policy == "mask":
        assert seq[3:] == [6.0] * 5, seq
        for got in survivors:
            assert got["active"] == [1, 1, 1, 0], got
    else:
        assert len(seq) == 4 and seq[3] in ("RankFailureError", "DistBackendError"), seq


@pytest.mark.slow
@pytest.mark.parametrize(
    "victim, count, kill",
    [(3, 40009, "3:0"), (3, 40009, "3:1"), (1, 5003, "3:0")],
    ids=["star-carrier-entry", "star-carrier-hand-over", "one-round"],
)
@pytest.mark.parametrize("policy", ["mask", "raise"])
def test_sigkill_mid_broadcast_across_hosts(policy, victim, count, kill):
    """4 hosts x 2 ranks, broadcasts from rank 0; one rank SIGKILLs itself at its fourth.
    160 KB, the star (the root sends stripe g to (h, g) on every other host, which hands it
    to its local peer in a second round): rank 3, a carrier on host 1, as it enters or
    before the hand-over (its stripe arrived, its local peer's not yet given; a hand-over
    in the first round would let the other hosts finish the op while rank 3's local peer
    fails: benchmarks/RESULTS.md, "Across hosts"). 20 KB, one round from the root: rank 1,
    the root's local peer, as it enters. mask: every survivor gets every op's value (the
    rerun over 7 ranks); raise: every survivor raises at the same op."""
    with netns.hosts(4, "mcmh") as t:
        res = run_ranks(
            t,
            [2, 2, 2, 2],
            "loop_broadcast",
            {"ops": 6, "count": count, "options": {"on_failure": policy}},
            rank_env={victim: {"MOONCAKE_FAULT_INJECT": kill}},
            timeout_s=150,
        )
    assert "error" in res[victim] or "results" not in res[victim], res[victim]  # it died
    survivors = [r for r in range(8) if r != victim]
    for r in survivors:
        assert "results" in res[r], (r, res[r])
    seqs = {r: res[r]["results"] for r in survivors}
    if policy == "mask":
        for r in survivors:
            assert seqs[r] == [10.0 + i for i in range(6)], (r, seqs[r])
            assert res[r]["active"] == [int(j != victim) for j in range(8)], (r, res[r])
    else:
        for r in survivors:
            assert seqs[r][:3] == [10.0, 11.0, 12.0], (r, seqs[r])
            assert seqs[r][3:] in (["RankFailureError"], ["DistBackendError"]), (r, seqs[r])


@pytest.mark.slow
def test_ranks_that_lost_the_store_with_rank_0_fence_and_stay_quiet():
    """Rank 0, which hosts the control store, SIGKILLs itself in its fourth all_reduce: the
    others cannot agree on anything without the store, so each raises RankFencedError; in
    the 3 s they stay afterwards their heartbeat threads stop calling the dead store
    instead of printing a C++ stack trace every 200 ms."""
    with netns.hosts(2, "mcmh") as t:
        res = run_ranks(
            t,
            [2, 2],
            "loop_all_reduce",
            {"ops": 8, "count": 1 << 10, "options": {"on_failure": "mask"}},
            rank_env={0: {"MOONCAKE_FAULT_INJECT": "3:0"}},
            timeout_s=150,
        )
    for r in (1, 2, 3):
        got = res[r]
        assert got.get("results", [None])[:3] == [10.0, 10.0, 10.0], (r, got)
        assert got["results"][3:] == ["RankFencedError"], (r, got)
        assert got["stack_traces"] <= 4, (r, got["stack_traces"], got["log"])


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mask", "raise"])
@pytest.mark.parametrize("how", ["round1", "in_flight"])
def test_sigkill_on_another_host_mid_all_to_all(policy, how):
    """Rank 3 (host 1) dies in its fourth all_to_all_single (16 MiB to each rank of the other
    host, 64 KiB to its mate), whose bytes across hosts move as direct bytes: "round1" by
    fault injection just before round 1; "in_flight" by SIGKILL 0.15 s into the op over
    1 Gbit/s links, while the live ranks are in the middle of sending each other frames
    larger than a socket's buffers (the sender finishes a half-sent frame with zeros; rank
    2, the victim's mate, may still be in that round and must not take them as data).
    mask: every survivor's blocks from ranks 0-2 hold their values from that op on and the
    block from rank 3 is -1 after it; raise: every survivor raises at the same op. Either
    way the survivors agree on the membership and the ops after it are right."""
    args = {"ops": 7, "count": 1 << 22, "local_count": 1 << 14, "options": {"on_failure": policy}}
    rank_env, rate_bit = None, None
    if how == "round1":
        rank_env = {3: {"MOONCAKE_FAULT_INJECT": "3:1"}}
    else:
        args.update(kill_at=[3, 3], kill_after_s=0.15)
        rate_bit = 10**9
    with netns.hosts(2, "mcmh", rate_bit=rate_bit) as t:
        res = run_ranks(t, [2, 2], "loop_all_to_all", args, rank_env=rank_env, timeout_s=150)
    assert "error" in res[3] or "results" not in res[3], res[3]  # it died
    survivors = {r: res[r] for r in (0, 1, 2)}
    for r, got in survivors.items():
        assert "results" in got, (r, got)
        seq = got["results"]
        full = [[100.0 * s + r for s in range(4)]] * 3
        assert seq[:3] == full, (r, seq)
        if policy == "mask":
            # the rerun over the survivors leaves the dead rank's block alone: untouched, or
            # holding what its first round had delivered before it died
            assert seq[3][:3] == [100.0 * s + r for s in range(3)], (r, seq)
            assert seq[3][3] in (-1.0, "uneven"), (r, seq)
            assert seq[4:] == [[100.0 * s + r for s in range(3)] + [-1.0]] * 3, (r, seq)
        else:
            assert len(seq) == 4 and seq[3] in ("RankFailureError", "DistBackendError"), seq
        assert got["active"] == [1, 1, 1, 0], got
    assert len({got["epoch"] for got in survivors.values()}) == 1, survivors


@pytest.mark.slow
def test_options_that_must_agree_raise_value_error_on_every_rank():
    """Rank 1 alone turns the two levels off: every rank raises ValueError naming the
    option at init_process_group (rank 0, which hosts the store, waits until all have
    seen it, so nobody gets a closed connection instead)."""
    with netns.hosts(2, "mcmh") as t:
        res = run_ranks(
            t,
            [2, 2],
            "every_op",
            rank_env={1: {"MH_OPTIONS": json.dumps({"hierarchical": False})}},
            timeout_s=120,
        )
    for r in range(4):
        assert res[r].get("error") == "ValueError", (r, res[r])
        assert "hierarchical" in res[r]["message"], (r, res[r]["message"])


EP_MODES = ["random", "masked", "dup", "skew", "last_host"]


def _run_ep(rph, scenario, timeout_s=200, **args):
    """An EP scenario of tests.multihost_rank on fresh hosts of rph[h] ranks."""
    with netns.hosts(len(rph), "mcmh") as t:
        return run_ranks(t, rph, scenario, {"ranks_per_host": rph, **args}, timeout_s=timeout_s)


def _ep_reference(rph, mode, T, H, E, K, dtype):
    """Per rank: the round trip's, the gradients' and the cached dispatch's values from
    tests.ep.eputil's float64 loops (expert e scales by 1 + e / 8)."""
    from tests.ep.eputil import make_inputs, ref_scaled_moe
    from tests.multihost_rank import ep_routing

    W = sum(rph)

    def scale(e):
        return 1.0 + e / 8

    out = []
    for r in range(W):
        x, idx, w = ep_routing(r, W, rph, mode, T, H, E, K, dtype)
        g = make_inputs(r, T, H, E, K, x.dtype, seed=1)[0]
        x2 = make_inputs(r, T, H, E, K, x.dtype, seed=2)[0]
        f = torch.tensor([[scale(int(e)) if e >= 0 else 0.0 for e in row] for row in idx.tolist()])
        dots = (g.double() * x.double()).sum(1, keepdim=True)
        ref = ref_scaled_moe(x, idx, w, scale)  # every round trip of x ends here
        out.append(
            {
                "combined": ref,
                "grad_x": ref_scaled_moe(g, idx, w, scale),
                "grad_w": f.double() * dots,
                "cached": ref_scaled_moe(x2, idx, w, scale),
                "low_latency": ref,
                "low_latency_fp8": ref,
                "low_latency_grad_x": ref_scaled_moe(g, idx, w, scale),
                "low_latency_grad_w": f.double() * dots,
            }
        )
    return out


@pytest.mark.slow(unless={"ranks_per_host": [[2, 2]], "dtype": ["float32"], "pieces": [None]})
@pytest.mark.parametrize(
    "ranks_per_host, dtype, pieces",
    [
        ([2, 2], "float32", None),
        ([3, 1], "float32", None),
        ([4, 4], "bfloat16", None),
        ([2, 2, 2, 2], "float32", None),
        ([2, 2], "bfloat16", 8),
        ([3, 1], "float32", 2),
        ([2, 2], "float32", 4),
    ],
    ids=["2x2", "3+1", "2x4-bf16", "4x2", "2x2-bf16-8pieces", "3+1-2pieces", "2x2-4pieces"],
)
def test_ep_across_hosts_equals_the_reference(ranks_per_host, dtype, pieces):
    """mooncake_ep across hosts, two levels (a token crosses to each remote host once, to a
    relay that forwards it inside the host; combine sums inside the host first): dispatch,
    combine, autograd (input and router-weight gradients), a cached dispatch and the
    low-latency round trip (also in two levels, with its gradients, and with fp8 rows)
    equal float64 references for random, -1, duplicate, skewed and all-on-the-last-host
    routing; also with the stages in 2, 4 and 8 pipelined pieces (small ``PIECE_BYTES``, the
    schedules of mooncake_ep._hosts._schedule)."""
    rph = ranks_per_host
    W = sum(rph)
    T, H, E, K = 24, 16, 2 * W, 4
    res = _run_ep(
        rph,
        "ep_round_trip",
        modes=EP_MODES,
        T=T,
        H=H,
        E=E,
        K=K,
        dtype=dtype,
        pieces=pieces,
    )
    # 16-bit: the relay rounds a host's sum once, the source once more
    rel = 2**-6 if dtype == "bfloat16" else 1e-6
    for r in range(W):
        _no_error(res, r)
    for mode in EP_MODES:
        ref = _ep_reference(rph, mode, T, H, E, K, dtype)
        for r in range(W):
            got = res[r][mode]
            assert got["two_level"] and got["low_latency_two_level"], (r, mode)
            assert got["pieces"] == (pieces or 1), (r, mode, got["pieces"])
            for key, want in ref[r].items():
                have = torch.tensor(got[key], dtype=torch.float64)
                # e4m3 keeps 3 mantissa bits: 2^-4 relative per element
                tol = (2**-3 if key == "low_latency_fp8" else rel) * (float(want.abs().max()) + 1)
                err = float((have - want).abs().max()) if want.numel() else 0.0
                assert err <= tol, f"rank {r} {mode} {key}: max error {err} > {tol}"


@pytest.mark.slow
@pytest.mark.parametrize("ranks_per_host", [[2, 2], [2, 2, 2, 2]], ids=["2x2", "4x2"])
def test_ep_round_trip_sends_one_row_per_token_and_remote_host(ranks_per_host):
    """The bytes that leave each host during a dispatch + combine, normal or low-latency,
    are the rows of one per (token, remote host) each way (T x remote hosts touched x H x element size, counted
    from the routing), not one per (token, remote rank) as rank to rank."""
    rph = ranks_per_host
    W, hosts = sum(rph), rank_hosts(rph)
    T, H, E, K = 64, 512, 2 * W, 4
    res = _run_ep(rph, "ep_round_trip", 150, modes=["random"], T=T, H=H, E=E, K=K, values=False)
    for r in range(W):
        _no_error(res, r)
    from tests.multihost_rank import ep_routing

    row = H * 4  # float32
    L = E // W
    exact = [0] * len(rph)  # bytes out of each host, one row per (token, remote host)
    flat = [0] * len(rph)  # rank to rank: one row per (token, remote rank)
    for r in range(W):
        idx = ep_routing(r, W, rph, "random", T, H, E, K)[1]
        for row_ids in idx.tolist():
            ranks = {e // L for e in row_ids if e >= 0}
            for h in {hosts[d] for d in ranks} - {hosts[r]}:
                exact[hosts[r]] += row  # there
                exact[h] += row  # and back
            for d in ranks:
                if hosts[d] != hosts[r]:
                    flat[hosts[r]] += row
                    flat[hosts[d]] += row
    assert res[0]["random"]["per_host"] is not None
    for h in range(len(rph)):
        for mode in ("host_tx", "ll_host_tx"):  # the normal and the low-latency round trip
            sent = min(res[r]["random"][mode] for r in range(W) if hosts[r] == h)
            # frames' headers and the small metadata (local ids, weights, relay masks) on top
            assert exact[h] <= sent <= 1.12 * exact[h] + (32 << 10), (mode, h, sent, exact[h])
        assert exact[h] < 0.9 * flat[h], (h, exact[h], flat[h])  # the test tells them apart


@pytest.mark.slow
@pytest.mark.parametrize("ranks_per_host", [[2, 2], [2, 2, 2, 2]], ids=["2x2", "4x2"])
def test_ep_relay_killed_between_dispatch_and_combine(ranks_per_host):
    """on_failure="mask": the last rank (a relay: the tokens of its local index on the
    other hosts reach its host through it) SIGKILLs itself after a two-level dispatch and
    a two-level low-latency dispatch. Every survivor's combines equal the reference without
    the dead rank's experts, and so does the next round trip (its host's remaining rank now relays every token); all
    survivors agree on the mask and the epoch."""
    from tests.ep.eputil import ref_scaled_moe
    from tests.multihost_rank import ep_routing

    rph = ranks_per_host
    W = sum(rph)
    victim = W - 1
    T, H, E, K = 24, 16, 2 * W, 4
    res = _run_ep(
        rph,
        "ep_kill_relay",
        150,
        victim=victim,
        T=T,
        H=H,
        E=E,
        K=K,
        options={"on_failure": "mask"},
    )
    L = E // W
    dead_experts = set(range(victim * L, (victim + 1) * L))
    want_active = [1] * W
    want_active[victim] = 0
    survivors = [r for r in range(W) if r != victim]
    for r in survivors:
        _no_error(res, r)
        got = res[r]
        assert got["active"] == want_active, got["active"]
        assert got["epoch"] == res[survivors[0]]["epoch"] > got["first_epoch"]
        assert got["two_level_after"] and got["low_latency_two_level"]
        x, idx, w = ep_routing(r, W, rph, "random", T, H, E, K)
        want = ref_scaled_moe(x, idx, w, lambda e: 1.0 + e / 8, excluded=dead_experts)
        for key in ("first", "low_latency_first", "second"):
            err = float((torch.tensor(got[key], dtype=torch.float64) - want).abs().max())
            assert err <= 1e-5 * (float(want.abs().max()) + 1), (r, key, err)


@pytest.mark.slow
def test_weight_sync_store_pull_crosses_the_trainers_link_once():
    """WeightSync across 1+2+2+2 hosts: one reader per rollout host relays (positions 0-2,
    passing each bucket on in parts), every reader holds the trainer's tensors, and the
    bytes that left the trainer's host during the pulls (kernel counters) are about one
    copy of the state, where reading from the trainer's segment would send six (and a relay
    that missed the position below it, still being claimed, a second one)."""
    tensors, tensor_mib = 8, 1
    with netns.hosts(4, "mcmh") as t:
        res = run_ranks(
            t,
            [1, 2, 2, 2],
            "ws_store_relay",
            {"tensors": tensors, "tensor_mib": tensor_mib},
            timeout_s=150,
        )
    for r in range(7):
        assert "digests" in res[r], (r, res[r])
    for r in range(1, 7):
        assert res[r]["digests"] == res[0]["digests"], r
    positions = [res[r]["position"] for r in range(1, 7)]
    assert sorted(p for p in positions if p is not None) == [0, 1, 2], positions
    for h in range(3):
        assert positions[2 * h : 2 * h + 2].count(None) == 1, positions
    state_bytes = tensors * tensor_mib << 20
    assert state_bytes <= res[0]["tx"] <= 1.15 * state_bytes, res[0]["tx"]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mask", "raise"])
def test_weight_sync_relay_killed_mid_sync_leaves_no_mix(policy):
    """GroupWeightSync from a trainer alone on its host to 3 hosts of 2 readers: the rank
    that passes the broadcast on inside its host (the first of host 1) dies after its second
    bucket of version 2. Every survivor holds all of version 1 or all of version 2 (its
    digests, computed here from the same seeds), with the version it reports; under
    "raise" every survivor keeps version 1 and says why."""
    import hashlib

    tensors, tensor_mib, victim = 4, 1, 1
    with netns.hosts(4, "mcmh") as t:
        res = run_ranks(
            t,
            [1, 2, 2, 2],
            "ws_group_kill",
            {
                "victim": victim,
                "tensors": tensors,
                "tensor_mib": tensor_mib,
                "options": {"on_failure": policy},
            },
            timeout_s=150,
        )

    def digests(version):
        g = torch.Generator().manual_seed(version)
        n = tensor_mib << 18
        return {
            f"w{i}": hashlib.sha256(torch.randn(n, generator=g).numpy().tobytes()).hexdigest()
            for i in range(tensors)
        }

    want = {1: digests(1), 2: digests(2)}
    versions = set()
    for r in [0, 2, 3, 4, 5, 6]:
        got = res[r]
        assert "version" in got, (r, got)
        assert got["version"] in (1, 2), (r, got["version"])
        if r:
            assert got["digests"] == want[got["version"]], (r, got["version"], got["error"])
            versions.add(got["version"])
        if policy == "raise":
            assert got["version"] == 1 and "aborted" in (got["error"] or ""), (r, got)
    assert len(versions) == 1, versions  # one outcome for every survivor
