"""Regression tests for bugs found by testing the ``mooncake`` process group (each was
reproduced by a script under /tmp/trial and fixed; these keep them fixed).

1. A large send to a live peer that never posts a recv raises ``DistBackendError`` after
   about the op timeout instead of hanging; a small send completes because it is buffered;
   the p2p link to that peer is then closed, but collectives go on and are right.
2. A send / isend to a SIGKILLed peer (dead before the send is posted, or dying while it
   is in flight) raises ``RankFailureError`` naming it, within a few seconds (far below
   the op timeout), whatever the message size: DESIGN.md, "p2p with a dead peer ...
   always raise".
3. A bad op inside ``batch_isend_irecv`` (send to self, to an out-of-range rank) raises,
   and later collectives and p2p batches still give the right values (they used to become
   silent no-ops).
4. Re-initialising the default group after ``destroy_process_group`` in the same processes,
   reusing the same store object (and switching transport), works every time.
5. ``Work.wait()`` on an irecv / async all_reduce pending when ``destroy_process_group`` is
   called returns promptly with an error (peer alive or killed).
6. An expanded (stride-0) output tensor raises ``ValueError`` before any traffic; the group
   goes on.
7. A cross-rank op-kind mismatch (all_reduce vs barrier) raises ``ValueError`` on every
   rank, whose message starts with that rank's own op and names the offending rank.
8. ``MOONCAKE_SHM_SLOT_BYTES=abc`` raises ``ValueError`` naming the variable.

Tests that kill ranks or break links build a fresh :class:`rankpool.RankPool` and close it
with ``graceful=False`` (killing every rank's process group); the others use cached pools.
Every rank function returns plain records; the assertions are made here, against values
computed independently in the test process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
import rankpool
import torch
import torch.distributed as dist
from rankpool import PoolStartError, RankPool, RemoteError

pytestmark = pytest.mark.timeout(90)

if not any(b == "mooncake" for b, _ in rankpool.parse_backends()):
    pytest.skip("regression tests of the mooncake backend", allow_module_level=True)

TRANSPORTS = ["shm", "tcp"]
SENTINEL = -7.0
LOCAL_ERROR_LIMIT_S = 1.0  # an error found by local or header checks comes at once
RUN_TIMEOUT = 60.0  # one pool.run


# ============================================================== rank-side helpers


def _store():
    """The default group's store (file store of the pool, behind torch's prefix)."""
    return dist.distributed_c10d._get_default_store()


def _outcome(fn):
    """Runs ``fn()``; a picklable record of what happened and how long it took."""
    t0 = time.monotonic()
    try:
        val = fn()
        return {"ok": True, "dt": time.monotonic() - t0, "val": val}
    except Exception as e:
        return {
            "ok": False,
            "dt": time.monotonic() - t0,
            "type": type(e).__name__,
            "mro": [c.__name__ for c in type(e).__mro__],
            "msg": str(e),
            "failed": list(getattr(e, "failed_ranks", []) or []),
        }


def _wait_dead(pid, limit=15.0):
    """Until process ``pid`` is gone (or a zombie); False if it is still alive at ``limit``."""
    deadline = time.monotonic() + limit
    while rankpool._alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _follow_up(rank, ws):
    """Normal collectives after an error: all_reduce (small and pipelined) and all_gather."""
    small = torch.full((5,), float(rank + 1))
    dist.all_reduce(small)
    big = torch.arange(100_000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(big)
    out = torch.full((ws * 3,), SENTINEL)
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank * 10)))
    return {"small": small, "big": big, "agit": out}


def _expected_follow_up(ws):
    s = ws * (ws + 1) / 2
    return {
        "small": torch.full((5,), s),
        "big": torch.arange(100_000, dtype=torch.float32) * s,
        "agit": (torch.arange(ws, dtype=torch.float32) * 10).repeat_interleave(3),
    }


def _check_follow_up(res, ws, ctx):
    exp = _expected_follow_up(ws)
    for r in range(ws):
        for k, v in exp.items():
            assert torch.equal(res[r]["after"][k], v), (
                f"{ctx} rank {r}: follow-up {k} gave {res[r]['after'][k][:8].tolist()}, "
                f"expected {v[:8].tolist()}"
            )


def _fmt(rec):
    if rec.get("ok"):
        return f"returned after {rec['dt']:.2f} s"
    return f"raised {rec['type']} after {rec['dt']:.2f} s: {rec['msg'][:300]}"


def _fresh_pool(ws, transport, op_timeout, **kw):
    return RankPool(ws, "mooncake", transport, op_timeout=op_timeout, **kw)


# ======================================= 1. large send to a live peer that never receives

NO_RECV_TIMEOUT = 3.0
SMALL_N = 1024  # 4 KiB of float32: buffered, completes without a matching recv
BIG_N = 10_000_000  # 40 MB of float32: cannot be buffered


def rank_send_no_recv(rank, ws):
    store = _store()
    out = {}
    dist.barrier()
    if rank == 0:
        small = torch.arange(SMALL_N, dtype=torch.float32)
        out["small"] = _outcome(lambda: dist.send(small, 1))
        store.set("reg1/small_sent", "1")
        store.wait(["reg1/small_recvd"], timedelta(seconds=30))
        big = torch.ones(BIG_N)
        out["big"] = _outcome(lambda: dist.send(big, 1))
        out["again"] = _outcome(lambda: dist.send(torch.ones(4), 1))
        store.set("reg1/big_done", "1")
    else:
        # the small send must complete before this rank posts its recv
        store.wait(["reg1/small_sent"], timedelta(seconds=30))
        r = torch.full((SMALL_N,), SENTINEL)
        dist.recv(r, 0)
        out["small_recv"] = r
        store.set("reg1/small_recvd", "1")
        # alive, but never posts a recv for the big message
        store.wait(["reg1/big_done"], timedelta(seconds=60))
    out["after"] = _follow_up(rank, ws)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_large_send_without_recv_times_out(transport):
    pool = _fresh_pool(2, transport, NO_RECV_TIMEOUT)
    try:
        res = pool.run(rank_send_no_recv, timeout=45)
    finally:
        pool.close(graceful=False)
    ctx = f"[{transport}]"
    small = res[0]["small"]
    assert small["ok"] and small["dt"] < LOCAL_ERROR_LIMIT_S, (
        f"{ctx} a 4 KiB send with no recv posted should complete once buffered; {_fmt(small)}"
    )
    assert torch.equal(res[1]["small_recv"], torch.arange(SMALL_N, dtype=torch.float32)), (
        f"{ctx} the buffered small message arrived wrong: {res[1]['small_recv'][:8].tolist()}"
    )
    big = res[0]["big"]
    assert not big["ok"], f"{ctx} a 40 MB send that nobody receives {_fmt(big)}"
    assert "DistBackendError" in big["mro"], f"{ctx} expected DistBackendError: {_fmt(big)}"
    assert 2.0 <= big["dt"] <= 15.0, (
        f"{ctx} the send should fail after about the op timeout ({NO_RECV_TIMEOUT} s): {_fmt(big)}"
    )
    again = res[0]["again"]
    assert not again["ok"] and "DistBackendError" in again["mro"], (
        f"{ctx} the p2p link to rank 1 is closed after the timed-out send, so a later send "
        f"to it must raise: {_fmt(again)}"
    )
    assert again["dt"] < LOCAL_ERROR_LIMIT_S, f"{ctx} send on a closed link: {_fmt(again)}"
    _check_follow_up(res, 2, ctx)


# ================================================== 2. send / isend to a SIGKILLed peer

DEAD_OP_TIMEOUT = 30.0  # detection must not wait for the op timeout
DEAD_BOUND = 5.0
DEAD_KILL_DELAY = 0.5  # "during": the victim dies this long after rank 0 starts sending
# (when the victim dies, elements sent): 4 KiB and 400 KB fit the shared-memory ring
# (1 MiB) and the loopback socket buffers, 4 MB and 40 MB do not
DEAD_CASES = {
    "before-4KB": ("before", 1024),
    "before-400KB": ("before", 100_000),
    "before-4MB": ("before", 1_000_000),
    "during-40MB": ("during", BIG_N),
}


def _p2p_send(mode, t):
    if mode == "isend":
        dist.isend(t, 1).wait()
    else:
        dist.send(t, 1)


def rank_send_dead_peer(rank, ws, mode, when, n):
    store = _store()
    if rank == 1:
        store.set("reg2/victim_pid", str(os.getpid()))
        if when == "during":
            store.wait(["reg2/sending"], timedelta(seconds=30))
            time.sleep(DEAD_KILL_DELAY)
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never reached
    pid = int(store.get("reg2/victim_pid"))
    t = torch.ones(n)
    if when == "before":
        assert _wait_dead(pid), f"rank 1 (pid {pid}) did not die"
        first = _outcome(lambda: _p2p_send(mode, t))
    else:
        store.set("reg2/sending", "1")  # nobody ever receives: the victim dies mid-message
        first = _outcome(lambda: _p2p_send(mode, t))
        # the victim's sockets close while it exits, a moment before /proc shows it dead
        first["dead_before_return"] = _wait_dead(pid, 2.0)
    other = "send" if mode == "isend" else "isend"
    second = _outcome(lambda: _p2p_send(other, torch.ones(1_000_000)))
    small = _outcome(lambda: _p2p_send(mode, torch.ones(4)))
    return {"first": first, "second": second, "small": small}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(DEAD_CASES))
@pytest.mark.parametrize("mode", ["send", "isend"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_send_to_killed_peer_raises_rank_failure(transport, mode, case):
    """DESIGN.md: "p2p with a dead peer ... always raise". "before": rank 1 is SIGKILLed
    (and gone) before rank 0 posts the send; "during": it dies while the send is in flight
    (no recv was ever posted). Then a send of the other kind and a tiny send must fail fast."""
    when, n = DEAD_CASES[case]
    pool = _fresh_pool(2, transport, DEAD_OP_TIMEOUT)
    try:
        res = pool.run(rank_send_dead_peer, mode, when, n, timeout=45, return_exceptions=True)
    finally:
        pool.close(graceful=False)
    ctx = f"[{transport}/{mode}/{case}]"
    assert isinstance(res[1], RemoteError) and res[1].type_name == "RankDied", (
        f"{ctx} rank 1 should have killed itself: {res[1]!r}"
    )
    assert not isinstance(res[0], RemoteError), (
        f"{ctx} rank 0: {res[0]}\n{getattr(res[0], 'traceback', '')}"
    )
    bound = {
        "first": DEAD_BOUND + (DEAD_KILL_DELAY if when == "during" else 0.0),
        "second": LOCAL_ERROR_LIMIT_S,
        "small": LOCAL_ERROR_LIMIT_S,
    }
    for key, what in (
        ("first", f"{mode} of {4 * n} B"),
        ("second", "then a 4 MB send of the other kind"),
        ("small", f"then a 16 B {mode}"),
    ):
        rec = res[0][key]
        assert not rec["ok"], f"{ctx} {what} to SIGKILLed rank 1 {_fmt(rec)}"
        assert rec["type"] == "RankFailureError", (
            f"{ctx} {what}: expected RankFailureError: {_fmt(rec)}"
        )
        assert rec["failed"] == [1], f"{ctx} {what}: failed_ranks {rec['failed']}, expected [1]"
        assert re.search(r"\brank 1\b", rec["msg"]), (
            f"{ctx} {what}: message does not name rank 1: {_fmt(rec)}"
        )
        assert rec["dt"] < bound[key], (
            f"{ctx} {what}: took {rec['dt']:.2f} s (op timeout {DEAD_OP_TIMEOUT} s): {_fmt(rec)}"
        )
    if when == "during":
        assert res[0]["first"]["dead_before_return"], f"{ctx} the send ended before the victim died"


# ================================== 3. a bad op in batch_isend_irecv poisons nothing later

BATCH_OP_TIMEOUT = 10.0


def _ring(rank, ws, n=6):
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    r = torch.full((n,), SENTINEL)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, torch.full((n,), float(rank + 1)), nxt),
            dist.P2POp(dist.irecv, r, prv),
        ]
    )
    for w in works:
        w.wait()
    return r


def rank_batch_bad_op(rank, ws, bad, with_good):
    bad_peer = rank if bad == "self" else ws + 5
    ops = []
    recv_buf = torch.full((4,), SENTINEL)
    if with_good:
        ops.append(dist.P2POp(dist.isend, torch.full((4,), float(100 + rank)), (rank + 1) % ws))
    ops.append(dist.P2POp(dist.isend, torch.ones(2), bad_peer))
    if with_good:
        ops.append(dist.P2POp(dist.irecv, recv_buf, (rank - 1) % ws))

    def call():
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    rec = _outcome(call)
    out = {"batch": rec, "after": _follow_up(rank, ws)}
    out["ring1"] = _ring(rank, ws)
    out["ring2"] = _ring(rank, ws, n=300_000)
    out["recv_buf"] = recv_buf
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("with_good", [False, True], ids=["alone", "with_good_ops"])
@pytest.mark.parametrize("bad", ["self", "out_of_range"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_batch_isend_irecv_bad_op_does_not_poison_group(transport, bad, with_good):
    ws = 2
    pool = rankpool.get_pool(ws, "mooncake", transport, timeout=BATCH_OP_TIMEOUT)
    res = pool.run(rank_batch_bad_op, bad, with_good, timeout=RUN_TIMEOUT)
    ctx = f"[{transport}/{bad}/{'with good ops' if with_good else 'alone'}]"
    for r in range(ws):
        rec = res[r]["batch"]
        assert not rec["ok"], (
            f"{ctx} rank {r}: batch_isend_irecv with a send to a bad peer {_fmt(rec)}"
        )
        assert "ValueError" in rec["mro"], (
            f"{ctx} rank {r}: a bad peer is a bad argument (ValueError): {_fmt(rec)}"
        )
        if bad == "out_of_range":
            assert re.search(rf"\b{ws + 5}\b", rec["msg"]), (
                f"{ctx} rank {r}: the bad peer is not named: {_fmt(rec)}"
            )
        assert rec["dt"] < LOCAL_ERROR_LIMIT_S * 5, f"{ctx} rank {r}: {_fmt(rec)}"
        # the good irecv of the batch either took the good isend's message or nothing
        prv = (r - 1) % ws
        got = res[r]["recv_buf"]
        assert torch.equal(got, torch.full((4,), SENTINEL)) or torch.equal(
            got, torch.full((4,), float(100 + prv))
        ), f"{ctx} rank {r}: the batch's good irecv buffer holds {got.tolist()}"
    _check_follow_up(res, ws, ctx)
    for r in range(ws):
        prv = (r - 1) % ws
        assert torch.equal(res[r]["ring1"], torch.full((6,), float(prv + 1))), (
            f"{ctx} rank {r}: later batch ring gave {res[r]['ring1'].tolist()}, expected {prv + 1}"
        )
        assert torch.equal(res[r]["ring2"], torch.full((300_000,), float(prv + 1))), (
            f"{ctx} rank {r}: later large batch ring gave {res[r]['ring2'][:8].tolist()}"
        )


# ========================== 4. re-initialising the default group with the same store

REINIT_SCRIPT = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    import mooncake_pg

    torch.set_num_threads(1)
    rank, ws, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    transports = sys.argv[4].split(",")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    out = []
    for it, tr in enumerate(transports):
        dist.init_process_group(backend="mooncake", store=store, rank=rank, world_size=ws,
                                timeout=timedelta(seconds=30),
                                pg_options=mooncake_pg.MooncakeOptions(timeout=10.0, transport=tr))
        rec = {"it": it, "requested": tr, "transport": mooncake_pg.backend_of().transport}
        x = torch.full((1000,), float(rank + it))
        dist.all_reduce(x)
        big = torch.arange(200_000, dtype=torch.float64) * (rank + 1) + it
        dist.all_reduce(big)
        nxt, prv = (rank + 1) % ws, (rank - 1) % ws
        r = torch.full((3,), -7.0)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), float(10 * it + rank)), nxt),
                                         dist.P2POp(dist.irecv, r, prv)]):
            w.wait()
        g = dist.new_group(list(range(ws)))
        y = torch.full((2,), float(rank))
        dist.all_reduce(y, group=g)
        rec.update(x=x.tolist()[:3] + [x.unique().numel()], big_sum=float(big.sum()),
                   big_first=big[:3].tolist(), ring=r.tolist(), group=y.tolist())
        out.append(rec)
        dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)
""")


def _kill_popen_group(p):
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


@pytest.mark.timeout(90)
def test_reinit_default_group_same_store(tmp_path):
    ws = 2
    transports = ["shm", "tcp", "shm"]
    script = tmp_path / "reinit_rank.py"
    script.write_text(REINIT_SCRIPT)
    # the store is hosted here, on a listening socket bound to 127.0.0.1 with a port the
    # kernel picks (TCPStore's own listener would bind every interface)
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(64)
    port = lsock.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=30),
        master_listen_fd=lsock.fileno(),
    )
    assert store.port == port
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [rankpool.REPO_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env.update(
        {
            "MOONCAKE_SOCKET_IFNAME": "lo",
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
    )
    env.pop("MOONCAKE_TRANSPORT", None)
    procs = []
    try:
        for r in range(ws):
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(r), str(ws), str(port), ",".join(transports)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=str(tmp_path),
                    start_new_session=True,
                    preexec_fn=rankpool._set_pdeathsig,
                )
            )
        outs = []
        deadline = time.monotonic() + 75
        for p in procs:
            try:
                text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_popen_group(p)
                text, _ = p.communicate()
                pytest.fail(
                    f"a rank did not finish re-initialising in time:\n{text.decode(errors='replace')[-4000:]}"
                )
            outs.append((p.returncode, text.decode(errors="replace")))
    finally:
        for p in procs:
            _kill_popen_group(p)
        del store
        try:
            lsock.close()
        except OSError:
            pass
    results = []
    for r, (rc, text) in enumerate(outs):
        assert rc == 0, f"rank {r} exited with {rc}:\n{text[-4000:]}"
        line = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        assert line, f"rank {r} printed no result:\n{text[-4000:]}"
        results.append(json.loads(line[-1][len("RESULT ") :]))
    ref_big = torch.arange(200_000, dtype=torch.float64)
    for r in range(ws):
        assert len(results[r]) == len(transports), f"rank {r}: {results[r]}"
        for it, tr in enumerate(transports):
            rec = results[r][it]
            ctx = f"rank {r} iteration {it} ({tr})"
            assert rec["transport"] == tr, f"{ctx}: group uses transport {rec['transport']!r}"
            s = float(sum(q + it for q in range(ws)))
            assert rec["x"] == [s, s, s, 1], f"{ctx}: all_reduce gave {rec['x']}, expected all {s}"
            big = ref_big * (ws * (ws + 1) / 2) + it * ws
            assert rec["big_sum"] == float(big.sum()) and rec["big_first"] == big[:3].tolist(), (
                f"{ctx}: pipelined all_reduce gave first {rec['big_first']} sum {rec['big_sum']}"
            )
            prv = (r - 1) % ws
            assert rec["ring"] == [float(10 * it + prv)] * 3, f"{ctx}: p2p ring gave {rec['ring']}"
            assert rec["group"] == [float(ws * (ws - 1) / 2)] * 2, (
                f"{ctx}: new_group all_reduce gave {rec['group']}"
            )


# ======================= 5. Work.wait() after destroy_process_group returns with an error

WAIT_OP_TIMEOUT = 30.0
WAIT_BOUND = 5.0


def rank_wait_after_destroy(rank, ws, kill):
    store = _store()
    dist.barrier()
    if rank == 1:
        if kill:
            store.set("reg5/victim_pid", str(os.getpid()))
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        # alive, but never sends and never joins the all_reduce
        store.wait(["reg5/done"], timedelta(seconds=60))
        return None
    r = torch.full((5,), SENTINEL)
    w_recv = dist.irecv(r, 1)
    w_ar = dist.all_reduce(torch.ones(3), async_op=True)
    time.sleep(0.3)
    pending = {"irecv": not w_recv.is_completed(), "all_reduce": not w_ar.is_completed()}
    destroy = _outcome(dist.destroy_process_group)
    out = {"pending": pending, "destroy": destroy}
    for name, w in (("irecv", w_recv), ("all_reduce", w_ar)):
        out[name] = _outcome(w.wait)
    out["recv_buf"] = r
    store.set("reg5/done", "1")
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("peer", ["alive", "killed"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_wait_after_destroy_returns_with_error(transport, peer):
    kill = peer == "killed"
    pool = _fresh_pool(2, transport, WAIT_OP_TIMEOUT)
    try:
        res = pool.run(rank_wait_after_destroy, kill, timeout=45, return_exceptions=True)
    finally:
        pool.close(graceful=False)
    ctx = f"[{transport}/peer {peer}]"
    if kill:
        assert isinstance(res[1], RemoteError) and res[1].type_name == "RankDied", (
            f"{ctx} rank 1: {res[1]!r}"
        )
    else:
        assert not isinstance(res[1], RemoteError), f"{ctx} rank 1: {res[1]}"
    assert not isinstance(res[0], RemoteError), (
        f"{ctx} rank 0: {res[0]}\n{getattr(res[0], 'traceback', '')}"
    )
    out = res[0]
    if not kill:
        assert out["pending"] == {"irecv": True, "all_reduce": True}, (
            f"{ctx} with rank 1 alive and idle both works should still be pending: {out['pending']}"
        )
    assert out["destroy"]["ok"] and out["destroy"]["dt"] < WAIT_BOUND, (
        f"{ctx} destroy_process_group {_fmt(out['destroy'])}"
    )
    for name in ("irecv", "all_reduce"):
        rec = out[name]
        assert not rec["ok"], (
            f"{ctx} {name}.wait() after destroy {_fmt(rec)} (nothing was received/reduced)"
        )
        assert rec["dt"] < WAIT_BOUND, f"{ctx} {name}.wait() after destroy {_fmt(rec)}"
    assert torch.equal(out["recv_buf"], torch.full((5,), SENTINEL)), (
        f"{ctx} the irecv buffer was written: {out['recv_buf'].tolist()}"
    )


# ================================================= 6. expanded (stride-0) output tensors

EXPAND_OP_TIMEOUT = 10.0
EXPAND_OPS = ["all_reduce", "broadcast", "all_gather_into_tensor", "all_gather"]


def rank_expanded_output(rank, ws, opname):
    base = torch.full((1,), SENTINEL)
    if opname == "all_reduce":
        x = base.expand(4)
        call = lambda: dist.all_reduce(x)  # noqa: E731
    elif opname == "broadcast":
        x = base.expand(4)
        call = lambda: dist.broadcast(x, src=0)  # noqa: E731
    elif opname == "all_gather_into_tensor":
        x = base.expand(ws * 4)
        call = lambda: dist.all_gather_into_tensor(x, torch.full((4,), float(rank + 1)))  # noqa: E731
    else:
        bases = [torch.full((1,), SENTINEL) for _ in range(ws)]
        outs = [b.expand(4) for b in bases]
        call = lambda: dist.all_gather(outs, torch.full((4,), float(rank + 1)))  # noqa: E731
    rec = _outcome(call)
    untouched = (
        bool((base == SENTINEL).all())
        if opname != "all_gather"
        else all(bool((b == SENTINEL).all()) for b in bases)
    )
    return {"rec": rec, "untouched": untouched, "after": _follow_up(rank, ws)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("opname", EXPAND_OPS)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_expanded_output_raises_value_error(transport, opname):
    ws = 2
    pool = rankpool.get_pool(ws, "mooncake", transport, timeout=EXPAND_OP_TIMEOUT)
    res = pool.run(rank_expanded_output, opname, timeout=RUN_TIMEOUT)
    ctx = f"[{transport}/{opname}]"
    for r in range(ws):
        rec = res[r]["rec"]
        assert not rec["ok"], f"{ctx} rank {r}: {opname} into an expanded output {_fmt(rec)}"
        assert "ValueError" in rec["mro"], f"{ctx} rank {r}: expected ValueError: {_fmt(rec)}"
        assert rec["dt"] < LOCAL_ERROR_LIMIT_S, f"{ctx} rank {r}: not raised at once: {_fmt(rec)}"
        assert res[r]["untouched"], f"{ctx} rank {r}: the expanded output's storage was written"
    _check_follow_up(res, ws, ctx)


# =============================================== 7. cross-rank op-kind mismatch message

MISMATCH_OP_TIMEOUT = 10.0


def rank_kind_mismatch(rank, ws, kinds):
    kind = kinds[rank]
    t = torch.full((4,), SENTINEL)
    if kind == "all_reduce":
        rec = _outcome(lambda: dist.all_reduce(t))
    else:
        rec = _outcome(dist.barrier)
    return {"rec": rec, "buf": t, "after": _follow_up(rank, ws)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "kinds",
    [
        ("all_reduce", "barrier"),
        ("barrier", "all_reduce"),
        ("all_reduce", "all_reduce", "barrier"),
        ("barrier", "all_reduce", "barrier"),
    ],
    ids=lambda k: "-".join(k),
)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_op_kind_mismatch_names_own_op_and_offender(transport, kinds):
    ws = len(kinds)
    pool = rankpool.get_pool(ws, "mooncake", transport, timeout=MISMATCH_OP_TIMEOUT)
    res = pool.run(rank_kind_mismatch, kinds, timeout=RUN_TIMEOUT)
    ctx = f"[{transport}/{'-'.join(kinds)}]"
    offenders = [j for j in range(ws) if kinds[j] != kinds[0]]
    for r in range(ws):
        rec = res[r]["rec"]
        assert not rec["ok"], f"{ctx} rank {r}: {kinds[r]} against {kinds} {_fmt(rec)}"
        assert "ValueError" in rec["mro"], f"{ctx} rank {r}: expected ValueError: {_fmt(rec)}"
        assert rec["msg"].startswith(f"mooncake {kinds[r]} "), (
            f"{ctx} rank {r} called {kinds[r]}; the message must start with its own op: {rec['msg'][:300]!r}"
        )
        who = ", ".join(str(j) for j in offenders)
        assert re.search(rf"offending rank\(s\): {re.escape(who)}(?![\d,])", rec["msg"]), (
            f"{ctx} rank {r}: message does not name offending rank(s) {offenders}: {rec['msg'][:300]!r}"
        )
        assert rec["dt"] < 5.0, f"{ctx} rank {r}: {_fmt(rec)}"
        if kinds[r] == "all_reduce":
            assert torch.equal(res[r]["buf"], torch.full((4,), SENTINEL)), (
                f"{ctx} rank {r}: the all_reduce buffer was modified: {res[r]['buf'].tolist()}"
            )
    _check_follow_up(res, ws, ctx)


# ========================================== 8. MOONCAKE_SHM_SLOT_BYTES that is not a number


def test_shm_slot_bytes_env_not_a_number(monkeypatch):
    import mooncake_pg

    monkeypatch.setenv("MOONCAKE_SHM_SLOT_BYTES", "abc")
    with pytest.raises(ValueError, match="MOONCAKE_SHM_SLOT_BYTES") as ei:
        mooncake_pg.config.env_defaults()
    assert "abc" in str(ei.value)
    with pytest.raises(ValueError, match="MOONCAKE_SHM_SLOT_BYTES"):
        mooncake_pg.config.resolve(mooncake_pg.MooncakeOptions())
    monkeypatch.setenv("MOONCAKE_SHM_SLOT_BYTES", "")
    assert mooncake_pg.config.env_defaults()["shm_slot_bytes"] == 1 << 20
    monkeypatch.setenv("MOONCAKE_SHM_SLOT_BYTES", "65536")
    assert mooncake_pg.config.env_defaults()["shm_slot_bytes"] == 65536
    monkeypatch.delenv("MOONCAKE_SHM_SLOT_BYTES")
    assert mooncake_pg.config.env_defaults()["shm_slot_bytes"] == 1 << 20


@pytest.mark.timeout(60)
def test_shm_slot_bytes_env_not_a_number_at_init():
    """The same through init_process_group in real rank processes: every rank's init
    raises ValueError naming the variable (no hang, no other error)."""
    with pytest.raises(PoolStartError) as ei:
        pool = RankPool(
            2, "mooncake", "shm", op_timeout=10.0, env={"MOONCAKE_SHM_SLOT_BYTES": "abc"}
        )
        pool.close(graceful=False)
    errs = ei.value.errors
    assert sorted(errs) == [0, 1], f"every rank's init should fail: {ei.value}"
    for r, e in errs.items():
        assert e.isinstance_of("ValueError"), f"rank {r}: {e!r}"
        assert "MOONCAKE_SHM_SLOT_BYTES" in e.message, f"rank {r}: {e!r}"


def test_active_ranks_env_and_options(monkeypatch):
    """MOONCAKE_ACTIVE_RANKS / MOONCAKE_IS_RECOVERY are parsed in config; explicit options win;
    malformed values name the variable."""
    import mooncake_pg
    from mooncake_pg.config import resolve

    monkeypatch.setenv("MOONCAKE_ACTIVE_RANKS", "2,0,1")
    monkeypatch.setenv("MOONCAKE_IS_RECOVERY", "1")
    s = resolve(mooncake_pg.MooncakeOptions())
    assert s["active_ranks"] == [0, 1, 2] and s["is_recovery"] is True
    s = resolve(mooncake_pg.MooncakeOptions(active_ranks=[1], is_recovery=False))
    assert s["active_ranks"] == [1] and s["is_recovery"] is False
    for bad in ("0,x", "1,1", "-1"):
        monkeypatch.setenv("MOONCAKE_ACTIVE_RANKS", bad)
        with pytest.raises(ValueError, match="MOONCAKE_ACTIVE_RANKS"):
            resolve(mooncake_pg.MooncakeOptions())
    for bad in ([], [0, 0], [-2]):
        with pytest.raises(ValueError, match="active_ranks"):
            mooncake_pg.MooncakeOptions(active_ranks=bad)
    with pytest.raises(ValueError, match="max_group_size"):
        mooncake_pg.MooncakeOptions(active_ranks=[0, 3], max_group_size=3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["not_founder", "max_group_size"])
def test_extension_seat_misuse_raises_at_init(case):
    """A process for a seat outside active_ranks that is not started with is_recovery, and
    a max_group_size different from the world size, raise ValueError from init (no hang)."""
    if case == "not_founder":
        opts, want, ranks = {"active_ranks": [0]}, "not among the initial active ranks", [1]
    else:
        opts, want, ranks = {"max_group_size": 3}, "max_group_size", [0, 1]
    with pytest.raises(PoolStartError) as ei:
        pool = RankPool(2, "mooncake", "shm", op_timeout=10.0, options=opts)
        pool.close(graceful=False)
    errs = ei.value.errors
    assert sorted(errs) == ranks, f"{case}: {ei.value}"
    for r, e in errs.items():
        assert e.isinstance_of("ValueError") and want in e.message, f"rank {r}: {e!r}"
