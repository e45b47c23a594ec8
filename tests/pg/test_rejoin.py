"""Kill-and-rejoin of the ``mooncake`` process group: a dead rank's seat is taken by a
replacement process (``MooncakeOptions(is_recovery=True)``) that the survivors admit with
``recover_ranks`` between two ops; ``sync_state`` hands it parameters, optimizer state and
RNG state.

Contract: docs/design.md "Membership and fault tolerance" (rejoin, step by step) and the part
of CASES.md FT-5: kill a rank, bring it back into its slot, repeat; and seats beyond the
founders (``active_ranks`` smaller than ``max_group_size``) filled through the same path.

Harness: every test builds a fresh :class:`rankpool.RankPool` (closed with
``graceful=False``, which kills each rank's process group). A victim SIGKILLs itself
between two ops; the *test process* then starts the replacement (:func:`respawn`: forked
from the pool's zygote like any rank, its own session, ``is_recovery=True`` on the pool's
``file://`` store) and wires it into the pool in the dead rank's place, so the next
``pool.run`` reaches the survivors and the joiner alike. Since the test process spawns
replacements, rank 0 can be a victim too.

Training-style tests use ``on_failure="mask"``; gradients are averaged over the ranks that
contributed: a trailing ``1`` is summed with the gradients, so the divisor comes from the
very op that produced the sum.

Environment: ``MOONCAKE_REJOIN_CYCLES`` (kill-and-rejoin cycles per transport, default 3).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests import rankpool
from tests.faults import kill_group, kill_self, wait_dead
from tests.rankpool import PoolStartError, RankPool, RemoteError

OP_TIMEOUT = 10.0  # MooncakeOptions.timeout: failures are detected by process handles
RUN_TIMEOUT = 45.0  # one pool.run
REJOIN_RUN_TIMEOUT = 30.0  # the rejoin call: join_group / recover_ranks fail well before it
JOIN_TIMEOUT = 20.0
W = 3
TRANSPORTS = ["shm", "tcp"]
CYCLES = int(os.environ.get("MOONCAKE_REJOIN_CYCLES", "3"))
# cycle i kills VICTIMS[i % 4]: FT-5's "kill rank 1, bring it back, repeat" with rank 0
# in between (3 cycles), then rank 2; a seat is refilled more than once by cycle 3
VICTIMS = [1, 0, 1, 2]

pytestmark = pytest.mark.timeout(120 + 20 * CYCLES)

if not any(b == "mooncake" for b, _ in rankpool.parse_backends()):
    pytest.skip("rejoin tests need the mooncake backend", allow_module_level=True)


# ======================================================================= harness


class RejoinPool:
    """A fresh RankPool plus :meth:`respawn` (replacement ranks started by the test)."""

    def __init__(
        self,
        transport,
        policy="mask",
        op_timeout=OP_TIMEOUT,
        options=None,
        rank_options=None,
        world_size=W,
    ):
        self.world_size = world_size
        self.pool = RankPool(
            world_size,
            "mooncake",
            transport,
            op_timeout=op_timeout,
            options={"on_failure": policy, **(options or {})},
            rank_options=rank_options,
        )
        self.extra_pids = []  # every pid this pool ever had (victims included)
        self.generation = [0] * world_size
        self.history = [(r, 0, pid) for r, pid in enumerate(self.pool.pids)]

    @property
    def logs(self):
        return self.pool.logs

    def run(self, fn, *args, timeout=RUN_TIMEOUT, **kw):
        try:
            return self.pool.run(fn, *args, timeout=timeout, return_exceptions=True, **kw)
        except rankpool.RankError as e:  # a timeout: add the membership log of every seat
            raise AssertionError(
                f"{fn.__name__}: {e}\n--- [mooncake] lines:\n" + self.mooncake_lines()
            ) from None

    def respawn(self, rank, timeout=60.0, extra_env=None):
        """Starts a replacement for dead seat ``rank`` (``is_recovery=True``) and puts it
        into the pool in place of the dead process once its init_process_group returned."""
        pool, s = self.pool, rankpool._get_session()
        old_pid = pool.pids[rank]
        self.extra_pids.append(old_pid)
        # its sockets close while it exits, a moment before /proc shows it dead
        assert wait_dead(old_pid, 5.0), f"seat {rank}: the old process {old_pid} still runs"
        try:
            pool.conns[rank].close()
        except OSError:
            pass
        self.generation[rank] += 1
        env = {
            "GLOO_SOCKET_IFNAME": "lo",
            "MOONCAKE_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        env.update(pool.env)
        env.update(extra_env or {})
        log = os.path.join(s.tmpdir, f"pool{pool.id}-rank{rank}-gen{self.generation[rank]}.log")
        options = dict(pool.options)
        options["is_recovery"] = True
        spec = {
            "sock": s.sock_path,
            "token": s.token,
            "pool_id": pool.id,
            "rank": rank,
            "world_size": pool.world_size,
            "backend": pool.backend,
            "transport": pool.transport,
            "op_timeout": pool.op_timeout,
            "options": options,
            "store_file": os.path.join(s.tmpdir, f"pool{pool.id}.store"),
            "log": log,
            "env": env,
        }
        pid = s.spawn(spec)
        self.extra_pids.append(pid)
        pool.pids[rank] = pid
        pool.logs[rank] = log
        deadline = time.monotonic() + timeout
        while True:
            got = s.accept(deadline)
            if got is None:
                raise AssertionError(
                    f"replacement for seat {rank} did not connect\n" + rankpool._log_tail(log)
                )
            conn, hello = got
            if (
                hello[0] == "hello"
                and hello[1] == pool.id
                and hello[2] == rank
                and hello[4] == s.token
            ):
                break
            conn.close()
        pool.pids[rank] = hello[3]
        self.extra_pids.append(hello[3])
        self.history.append((rank, self.generation[rank], hello[3]))
        pool.conns[rank] = conn
        if not conn.poll(max(0.1, deadline - time.monotonic())):
            raise AssertionError(
                f"replacement for seat {rank}: init_process_group(is_recovery=True) "
                f"did not return\n" + rankpool._log_tail(log)
            )
        msg = rankpool._loads(conn.recv_bytes())
        if msg[0] != "ready":
            raise AssertionError(
                f"replacement for seat {rank}: init failed: {msg[2]!r}\n"
                f"{getattr(msg[2], 'traceback', '')}\n" + rankpool._log_tail(log)
            )
        pool.dirty = False
        return hello[3]

    def mooncake_lines(self):
        out = ["seat processes (rank, generation, pid): " + ", ".join(map(str, self.history))]
        for r in range(self.world_size):
            paths = [
                os.path.join(rankpool._get_session().tmpdir, f"pool{self.pool.id}-rank{r}.log")
            ]
            paths += [
                os.path.join(
                    rankpool._get_session().tmpdir, f"pool{self.pool.id}-rank{r}-gen{g}.log"
                )
                for g in range(1, self.generation[r] + 1)
            ]
            for gen, p in enumerate(paths):
                for line in rankpool._log_tail(p, 200_000).splitlines():
                    if (
                        "[mooncake]" in line
                        or "[test_rejoin]" in line
                        or "[fault]" in line
                        or "Fatal Python" in line
                        or "Error" in line
                    ):
                        out.append(f"rank {r}/gen {gen}: {line}")
        return "\n".join(out)

    def close(self):
        self.pool.close(graceful=False)
        for pid in self.extra_pids:
            kill_group(pid)


@pytest.fixture
def rj_pool():
    pools = []

    def make(*a, **kw):
        p = RejoinPool(*a, **kw)
        pools.append(p)
        return p

    yield make
    for p in pools:
        p.close()


def expect_ok(rp, res, ranks, what):
    bad = {r: res[r] for r in ranks if isinstance(res[r], RemoteError)}
    assert not bad, (
        f"{what}: ranks raised:\n"
        + "\n".join(
            f"rank {r}: {e.type_name}: {e.message}\n{e.traceback}"
            + (
                f"\nrank {r} log tail:\n{e.log[-1500:]}"
                if e.type_name == "RankDied" and e.log
                else ""
            )
            for r, e in bad.items()
        )
        + "\n"
        + rp.mooncake_lines()
    )


def expect_died(rp, res, victim, what):
    assert isinstance(res[victim], RemoteError) and res[victim].type_name == "RankDied", (
        f"{what}: victim rank {victim} should have died, got {res[victim]!r}\n{rp.mooncake_lines()}"
    )


# ================================================================ rank-side code

_ST = {}  # per rank process: model, optimizer, step counter


def _digest(*tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _opt_snapshot(opt):
    """Optimizer state as plain data (tensors cloned) plus a digest."""
    sd = opt.state_dict()
    state = {}
    for idx in sorted(sd["state"]):
        state[idx] = {
            k: (v.detach().clone() if torch.is_tensor(v) else v)
            for k, v in sorted(sd["state"][idx].items())
        }
    h = hashlib.sha256()
    for idx, st in state.items():
        for k, v in st.items():
            h.update(f"{idx}/{k}".encode())
            h.update(_digest(v).encode() if torch.is_tensor(v) else repr(v).encode())
    groups = json.dumps(sd["param_groups"], sort_keys=True, default=str)
    h.update(groups.encode())
    return {"state": state, "param_groups": groups, "digest": h.hexdigest()}


def _make_model(kind, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if kind == "adam":
        opt = torch.optim.Adam(
            model.parameters(),
            lr=1e-2 if seed < 1000 else 0.5,
            betas=(0.9, 0.99) if seed < 1000 else (0.5, 0.5),
        )
    else:
        opt = torch.optim.SGD(
            model.parameters(),
            lr=5e-2 if seed < 1000 else 0.7,
            momentum=0.9 if seed < 1000 else 0.1,
        )
    return model, opt


def _batch(rank, step):
    g = torch.Generator().manual_seed(1_000_003 * (step + 1) + 7919 * rank)
    x = torch.randn(16, 8, generator=g)
    y = torch.randn(16, 4, generator=g)
    return x, y


def _train_step(rank, st):
    """One data-parallel step: gradients averaged over the ranks that contributed."""
    model, opt = st["model"], st["opt"]
    x, y = _batch(rank, st["step"])
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    params = list(model.parameters())
    flat = torch.cat([p.grad.flatten() for p in params] + [torch.ones(1)])
    dist.all_reduce(flat)
    n = flat[-1].item()
    off = 0
    for p in params:
        k = p.numel()
        p.grad.copy_(flat[off : off + k].view_as(p) / n)
        off += k
    opt.step()
    st["step"] += 1
    st.setdefault("contributors", []).append(int(n))
    return int(n)


def _die(rank, why):
    kill_self(rank, why)


def rank_setup(rank, ws, kind):
    _ST.clear()
    model, opt = _make_model(kind, 17)  # same init everywhere
    _ST.update(model=model, opt=opt, step=0, kind=kind)
    return True


def rank_train(rank, ws, steps, victim=None, kill_at=None):
    """``steps`` training steps; ``victim`` SIGKILLs itself before step ``kill_at``."""
    ns = []
    for i in range(steps):
        if rank == victim and i == kill_at:
            kill_self(rank, f"before step {_ST['step']}")
        ns.append(_train_step(rank, _ST))
    import mooncake_pg

    return {
        "n": ns,
        "step": _ST["step"],
        "active": mooncake_pg.get_active_ranks().tolist(),
        "epoch": mooncake_pg.get_epoch(),
        "rng": _digest(torch.get_rng_state()),
    }


def rank_rejoin(rank, ws, joiner, step, max_steps=2000):
    """The joiner joins and syncs; the survivors train and poll for it between steps."""
    import mooncake_pg

    t0 = time.monotonic()
    if rank == joiner:
        kind = _ST.get("kind") or step["kind"]
        _ST.clear()
        model, opt = _make_model(kind, 5000 + rank)  # different init and hyper-parameters
        # give the fresh optimizer some (wrong) state of its own, to be overwritten
        x, y = _batch(99, 12345)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        _ST.update(model=model, opt=opt, step=step["step"], kind=kind)
        mooncake_pg.join_group(None, timeout=JOIN_TIMEOUT)
        t_join = time.monotonic() - t0
        mooncake_pg.sync_state(model, opt)
        return {
            "joined_after": t_join,
            "steps": 0,
            "pending_seen": [],
            "active": mooncake_pg.get_active_ranks().tolist(),
            "epoch": mooncake_pg.get_epoch(),
        }
    pending_seen = []
    for i in range(max_steps):
        _train_step(rank, _ST)
        pend = mooncake_pg.get_pending_ranks()
        if pend and not pending_seen:
            pending_seen = list(pend)
        mooncake_pg.recover_ranks(None, pend)
        if all(mooncake_pg.get_active_ranks().tolist()):
            mooncake_pg.sync_state(_ST["model"], _ST["opt"])
            return {
                "joined_after": time.monotonic() - t0,
                "steps": i + 1,
                "pending_seen": pending_seen,
                "step": _ST["step"],
                "active": mooncake_pg.get_active_ranks().tolist(),
                "epoch": mooncake_pg.get_epoch(),
            }
        time.sleep(0.005)
    raise AssertionError(
        f"rank {rank}: seat {joiner} not admitted after {max_steps} steps "
        f"(pending {mooncake_pg.get_pending_ranks()}, "
        f"active {mooncake_pg.get_active_ranks().tolist()})"
    )


def rank_check(rank, ws):
    """State digests, membership and a few ops over the full group."""
    import mooncake_pg

    model, opt = _ST["model"], _ST["opt"]
    out = {
        "active": mooncake_pg.get_active_ranks().tolist(),
        "epoch": mooncake_pg.get_epoch(),
        "params": _digest(*list(model.parameters())),
        "opt": _opt_snapshot(opt)["digest"],
        "step": _ST["step"],
    }
    out["rand"] = torch.rand(4).tolist()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["sum"] = t.item()
    big = torch.full((70_000,), float(rank + 1))
    dist.all_reduce(big)
    out["big"] = torch.unique(big).tolist()
    o = torch.full((ws * 3,), -7.0)
    dist.all_gather_into_tensor(o, torch.full((3,), float(rank * 10)))
    out["gather"] = o.tolist()
    lst = [torch.full((2,), -7.0) for _ in range(ws)]
    dist.all_gather(lst, torch.full((2,), float(rank)))
    out["gather_list"] = [x.tolist() for x in lst]
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    r = torch.full((1024,), -1, dtype=torch.int32)
    reqs = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, torch.arange(1024, dtype=torch.int32) + 1000 * rank, nxt),
            dist.P2POp(dist.irecv, r, prv),
        ]
    )
    for q in reqs:
        q.wait()
    out["ring"] = torch.equal(r, torch.arange(1024, dtype=torch.int32) + 1000 * prv)
    # plain send/recv both ways between neighbours 0 -> 1 -> 2 -> 0
    r2 = torch.full((16,), -1.0)
    if rank % 2 == 0:
        dist.send(torch.full((16,), float(rank)), nxt)
        dist.recv(r2, prv)
    else:
        dist.recv(r2, prv)
        dist.send(torch.full((16,), float(rank)), nxt)
    out["sendrecv"] = r2.tolist() == [float(prv)] * 16
    dist.barrier()
    return out


def check_full_group(rp, ctx, epoch, want_step=None):
    res = rp.run(rank_check)
    expect_ok(rp, res, range(W), f"{ctx} check")
    logs = rp.mooncake_lines()
    for r in range(W):
        o = res[r]
        assert o["active"] == [1] * W, f"{ctx} rank {r}: active {o['active']}\n{logs}"
        assert o["epoch"] == epoch, f"{ctx} rank {r}: epoch {o['epoch']}, expected {epoch}\n{logs}"
        assert o["sum"] == 6.0, f"{ctx} rank {r}: all_reduce of [rank+1] gave {o['sum']}\n{logs}"
        assert o["big"] == [6.0], f"{ctx} rank {r}: large all_reduce gave {o['big']}"
        assert o["gather"] == [0.0] * 3 + [10.0] * 3 + [20.0] * 3, (
            f"{ctx} rank {r}: all_gather {o['gather']}"
        )
        assert o["gather_list"] == [[0.0] * 2, [1.0] * 2, [2.0] * 2], (
            f"{ctx} rank {r}: {o['gather_list']}"
        )
        assert o["ring"], f"{ctx} rank {r}: batch_isend_irecv ring delivered wrong data"
        assert o["sendrecv"], f"{ctx} rank {r}: send/recv ring delivered wrong data"
        if want_step is not None:
            assert o["step"] == want_step, f"{ctx} rank {r}: step {o['step']}, expected {want_step}"
    for key in ("params", "opt", "rand"):
        vals = {r: res[r][key] for r in range(W)}
        assert len({json.dumps(v) for v in vals.values()}) == 1, (
            f"{ctx}: {key} differ across ranks after sync_state: {vals}\n{logs}"
        )
    return res


# ======================================================== 1. kill-and-rejoin cycles


@pytest.mark.slow(unless={"transport": ["shm"]})
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_kill_and_rejoin_cycles(rj_pool, transport):
    """W=3, mask: train, SIGKILL a rank (1, 0, 2, ...), survivors train on, a replacement
    takes the seat, sync_state; after every cycle the full group is back and consistent."""
    t_start = time.monotonic()
    kind = "adam" if transport == "shm" else "sgd"
    rp = rj_pool(transport)
    res = rp.run(rank_setup, kind)
    expect_ok(rp, res, range(W), "setup")
    step = 0
    res = rp.run(rank_train, 3)
    expect_ok(rp, res, range(W), "warm-up")
    step += 3
    assert all(res[r]["n"] == [3, 3, 3] for r in range(W)), res
    timings = []
    for c in range(CYCLES):
        victim = VICTIMS[c % len(VICTIMS)]
        survivors = [r for r in range(W) if r != victim]
        ctx = f"[{transport} cycle {c + 1}/{CYCLES} victim {victim}]"
        t0 = time.monotonic()
        # the victim dies before its 3rd step; the survivors train 6 steps in all
        res = rp.run(rank_train, 6, victim, 2)
        expect_died(rp, res, victim, ctx)
        expect_ok(rp, res, survivors, ctx)
        for r in survivors:
            ns = res[r]["n"]
            assert ns[:2] == [3, 3] and ns[-1] == 2 and ns == sorted(ns, reverse=True), (
                f"{ctx} rank {r}: contributors per step {ns}\n{rp.mooncake_lines()}"
            )
            assert res[r]["active"] == [0 if j == victim else 1 for j in range(W)], (
                f"{ctx} {res[r]}"
            )
            assert res[r]["epoch"] == 2 * c + 1, (
                f"{ctx} rank {r}: epoch {res[r]['epoch']} after the kill"
            )
        assert len({json.dumps(res[r]["n"]) for r in survivors}) == 1, f"{ctx}: {res}"
        step += 6
        t_kill = time.monotonic() - t0
        rp.respawn(victim)
        t_spawn = time.monotonic() - t0
        res = rp.run(rank_rejoin, victim, {"step": step, "kind": kind}, timeout=REJOIN_RUN_TIMEOUT)
        expect_ok(
            rp,
            res,
            range(W),
            f"{ctx} rejoin (seat {victim} refilled for the {rp.generation[victim]}. time)",
        )
        extra = {res[r]["steps"] for r in survivors}
        assert len(extra) == 1, f"{ctx}: survivors admitted the joiner after different steps: {res}"
        step += extra.pop()
        for r in range(W):
            assert res[r]["active"] == [1] * W and res[r]["epoch"] == 2 * c + 2, (
                f"{ctx} rank {r}: {res[r]}"
            )
        # the joiner's own step counter is the test's bookkeeping; set it from the survivors
        res = rp.run(rank_set_step, step)
        expect_ok(rp, res, range(W), f"{ctx} set step")
        check_full_group(rp, ctx, 2 * (c + 1), want_step=step)
        # and training goes on over all three
        res = rp.run(rank_train, 2)
        expect_ok(rp, res, range(W), f"{ctx} train after rejoin")
        assert all(res[r]["n"] == [3, 3] for r in range(W)), f"{ctx}: {res}"
        step += 2
        timings.append((time.monotonic() - t0, t_kill, t_spawn))
    check_full_group(rp, f"[{transport} end]", 2 * CYCLES, want_step=step)
    print(
        f"[{transport}] {CYCLES} cycles in {time.monotonic() - t_start:.2f} s; per cycle "
        "(total, kill+train, +respawn): "
        + ", ".join(f"({a:.2f}, {b:.2f}, {d:.2f})" for a, b, d in timings)
    )


def rank_set_step(rank, ws, step):
    _ST["step"] = step
    return True


# ================================================== 2. sync_state with Adam and RNG


def rank_adam_prepare(rank, ws):
    """Distinct RNG streams per rank (advanced by different amounts) and Adam state."""
    rank_setup(rank, ws, "adam")
    for _ in range(4):
        _train_step(rank, _ST)
    torch.manual_seed(4242 + 31 * rank)
    torch.rand(rank * 5 + 1)
    return {"rng": _digest(torch.get_rng_state())}


def rank_adam_after(rank, ws):
    """After the rejoin: optimizer state, hyper-parameters, parameters, RNG draws."""
    snap = _opt_snapshot(_ST["opt"])
    return {
        "state": snap["state"],
        "param_groups": snap["param_groups"],
        "params": [p.detach().clone() for p in _ST["model"].parameters()],
        "rng": _digest(torch.get_rng_state()),
        "draw": torch.rand(8),
    }


@pytest.mark.parametrize("victim", [0, 2])
def test_sync_state_adam_and_rng(rj_pool, victim):
    """The joiner's Adam state (exp_avg, exp_avg_sq, step), hyper-parameters, parameters and
    RNG equal the source's afterwards; the source is the lowest active rank that did not
    just join (1 when seat 0 rejoins, else 0)."""
    transport = "shm" if victim == 0 else "tcp"
    rp = rj_pool(transport)
    res = rp.run(rank_adam_prepare)
    expect_ok(rp, res, range(W), "prepare")
    survivors = [r for r in range(W) if r != victim]
    res = rp.run(rank_train, 3, victim, 1)
    expect_died(rp, res, victim, "kill")
    expect_ok(rp, res, survivors, "kill")
    rng_before = res
    assert rng_before[survivors[0]]["rng"] != rng_before[survivors[1]]["rng"]
    rp.respawn(victim)
    step = res[survivors[0]]["step"]
    res = rp.run(rank_rejoin, victim, {"step": step, "kind": "adam"}, timeout=REJOIN_RUN_TIMEOUT)
    expect_ok(rp, res, range(W), "rejoin")
    src = min(survivors)
    after = rp.run(rank_adam_after)
    expect_ok(rp, after, range(W), "after")
    ctx = f"[{transport} victim {victim} src {src}]"
    j, s = after[victim], after[src]
    assert set(j["state"]) == set(s["state"]) and len(s["state"]) == 4, f"{ctx}: {list(j['state'])}"
    for idx in s["state"]:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            a, b = j["state"][idx][k], s["state"][idx][k]
            assert torch.is_tensor(a) and torch.is_tensor(b), f"{ctx} param {idx} {k}: {a!r} {b!r}"
            assert a.dtype == b.dtype and torch.equal(a, b), (
                f"{ctx} param {idx} {k}: joiner {a} source {b}"
            )
        assert set(j["state"][idx]) == set(s["state"][idx]), f"{ctx}: {j['state'][idx].keys()}"
    assert j["param_groups"] == s["param_groups"], (
        f"{ctx}: param_groups {j['param_groups']} vs {s['param_groups']}"
    )
    for a, b in zip(j["params"], s["params"]):
        assert torch.equal(a, b), f"{ctx}: parameters differ"
    # RNG: the joiner's state equals the source's (the source's state from before the sync)
    assert j["rng"] == s["rng"] == rng_before[src]["rng"], (
        f"{ctx}: RNG joiner {j['rng'][:12]} source {s['rng'][:12]} "
        f"source-before {rng_before[src]['rng'][:12]}"
    )
    assert torch.equal(j["draw"], s["draw"]), (
        f"{ctx}: torch.rand after sync: {j['draw']} vs {s['draw']}"
    )
    # the whole group is usable and consistent
    check_full_group(rp, ctx, 2)


# ================================================= 3. pending ranks and API errors


def _raises(fn, exc=Exception):
    t0 = time.monotonic()
    try:
        fn()
    except exc as e:
        return {
            "raised": True,
            "type": type(e).__name__,
            "mro": [c.__name__ for c in type(e).__mro__],
            "msg": str(e)[:300],
            "dt": time.monotonic() - t0,
        }
    except BaseException as e:
        return {
            "raised": True,
            "type": type(e).__name__,
            "mro": [c.__name__ for c in type(e).__mro__],
            "msg": str(e)[:300],
            "dt": time.monotonic() - t0,
            "unexpected": True,
        }
    return {"raised": False, "dt": time.monotonic() - t0}


def rank_api_after_kill(rank, ws, victim):
    """Survivors: the victim dies; nobody is pending; bad recover_ranks calls raise."""
    import mooncake_pg

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if rank == victim:
        kill_self(rank, "after the first all_reduce")
    out = {}
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # masked: completes over the survivors
    deadline = time.monotonic() + 10
    while mooncake_pg.get_active_ranks().tolist()[victim] and time.monotonic() < deadline:
        time.sleep(0.01)
    out["active"] = mooncake_pg.get_active_ranks().tolist()
    out["epoch"] = mooncake_pg.get_epoch()
    out["pending"] = mooncake_pg.get_pending_ranks()
    out["no_replacement"] = _raises(lambda: mooncake_pg.recover_ranks(None, [victim]))
    out["active_rank"] = _raises(lambda: mooncake_pg.recover_ranks(None, [rank]))
    out["out_of_range"] = _raises(lambda: mooncake_pg.recover_ranks(None, [W]))
    out["empty"] = _raises(lambda: mooncake_pg.recover_ranks(None, []))
    out["empty_pending"] = _raises(
        lambda: mooncake_pg.recover_ranks(None, mooncake_pg.get_pending_ranks())
    )
    out["epoch_after"] = mooncake_pg.get_epoch()
    out["active_after"] = mooncake_pg.get_active_ranks().tolist()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["sum"] = t.item()
    return out


JOINER_OPS = {
    "collectives": ["all_reduce", "broadcast", "all_gather", "barrier"],
    "p2p": ["send", "recv", "batch_isend_irecv"],
}
_JOINER_OP_FNS = {
    "all_reduce": lambda: dist.all_reduce(torch.ones(4)),
    "broadcast": lambda: dist.broadcast(torch.ones(4), 0),
    "all_gather": lambda: dist.all_gather_into_tensor(torch.empty(3 * W), torch.ones(3)),
    "barrier": lambda: dist.barrier(),
    "send": lambda: dist.send(torch.ones(4), 0),
    "recv": lambda: dist.recv(torch.ones(4), 0),
    "batch_isend_irecv": lambda: [
        q.wait()
        for q in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, torch.ones(4), 0), dist.P2POp(dist.irecv, torch.ones(4), 1)]
        )
    ],
}


def rank_api_waiting(rank, ws, victim, kind):
    """Joiner (before join_group): ops raise. Survivors: the seat shows up as pending and
    ops among the survivors still work."""
    import mooncake_pg

    if rank == victim:
        out = {"active": mooncake_pg.get_active_ranks().tolist()}
        for op in JOINER_OPS[kind]:
            sys.stderr.write(f"[test_rejoin] rank {rank}: {op} before join_group\n")
            sys.stderr.flush()
            out[op] = _raises(_JOINER_OP_FNS[op])
        return out
    deadline = time.monotonic() + 15
    pend = mooncake_pg.get_pending_ranks()
    while pend != [victim] and time.monotonic() < deadline:
        time.sleep(0.01)
        pend = mooncake_pg.get_pending_ranks()
    out = {
        "pending": pend,
        "epoch": mooncake_pg.get_epoch(),
        "active": mooncake_pg.get_active_ranks().tolist(),
    }
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["sum"] = t.item()
    out["pending_after_op"] = mooncake_pg.get_pending_ranks()
    # still an active rank: not admissible
    out["active_rank"] = _raises(lambda: mooncake_pg.recover_ranks(None, [rank]))
    return out


def rank_api_admit(rank, ws, victim):
    import mooncake_pg

    if rank == victim:
        mooncake_pg.join_group(None, timeout=JOIN_TIMEOUT)
        out = {"pending": mooncake_pg.get_pending_ranks()}
    else:
        out = {"pending_before": mooncake_pg.get_pending_ranks()}
        mooncake_pg.recover_ranks(None, mooncake_pg.get_pending_ranks())
        out["pending"] = mooncake_pg.get_pending_ranks()
    out["epoch"] = mooncake_pg.get_epoch()
    out["active"] = mooncake_pg.get_active_ranks().tolist()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["sum"] = t.item()
    # the rejoined seat is active now: recovering it again is a ValueError on every rank
    out["again"] = _raises(lambda: mooncake_pg.recover_ranks(None, [victim]))
    out["epoch_after"] = mooncake_pg.get_epoch()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["sum2"] = t.item()
    return out


def _assert_value_error(ctx, r, what, rec, logs=""):
    assert rec["raised"] and not rec.get("unexpected") and "ValueError" in rec["mro"], (
        f"{ctx} rank {r}: {what} should raise ValueError, got {rec}\n{logs}"
    )


@pytest.mark.parametrize("ops", list(JOINER_OPS))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pending_and_recover_errors(rj_pool, transport, ops):
    """get_pending_ranks is empty until a replacement exists and lists the seat while it
    waits; recover_ranks raises ValueError for an active seat, an out-of-range seat and a
    seat with no replacement; on the replacement, ops (``ops``: collectives / p2p) before
    join_group raise at once (the process survives); then it is admitted normally."""
    victim = 2
    survivors = [0, 1]
    ctx = f"[{transport}/{ops}]"
    rp = rj_pool(transport)
    res = rp.run(rank_api_after_kill, victim)
    expect_died(rp, res, victim, ctx)
    expect_ok(rp, res, survivors, ctx)
    logs = rp.mooncake_lines()
    for r in survivors:
        o = res[r]
        assert o["active"] == [1, 1, 0] and o["epoch"] == 1, f"{ctx} rank {r}: {o}\n{logs}"
        assert o["pending"] == [], f"{ctx} rank {r}: pending before any replacement: {o['pending']}"
        _assert_value_error(
            ctx, r, f"recover_ranks([{victim}]) with no replacement", o["no_replacement"], logs
        )
        _assert_value_error(ctx, r, f"recover_ranks([{r}]) (active)", o["active_rank"], logs)
        _assert_value_error(ctx, r, f"recover_ranks([{W}]) (out of range)", o["out_of_range"], logs)
        assert not o["empty"]["raised"] and not o["empty_pending"]["raised"], f"{ctx} rank {r}: {o}"
        assert o["epoch_after"] == 1 and o["active_after"] == [1, 1, 0], f"{ctx} rank {r}: {o}"
        assert o["sum"] == 3.0, f"{ctx} rank {r}: all_reduce after the errors gave {o['sum']}"

    rp.respawn(victim)
    res = rp.run(rank_api_waiting, victim, ops)
    expect_ok(
        rp, res, range(W), f"{ctx} waiting (the joiner tried {JOINER_OPS[ops]} before join_group)"
    )
    logs = rp.mooncake_lines()
    j = res[victim]
    for op in JOINER_OPS[ops]:
        rec = j[op]
        assert rec["raised"] and not rec.get("unexpected"), (
            f"{ctx} joiner: {op} before join_group should raise, got {rec}\n{logs}"
        )
        assert rec["dt"] < OP_TIMEOUT / 2, (
            f"{ctx} joiner: {op} before join_group raised only after {rec['dt']:.1f} s "
            f"(op timeout {OP_TIMEOUT} s): {rec}"
        )
    for r in survivors:
        o = res[r]
        assert o["pending"] == [victim], (
            f"{ctx} rank {r}: pending while the joiner waits: {o}\n{logs}"
        )
        assert o["epoch"] == 1 and o["active"] == [1, 1, 0], f"{ctx} rank {r}: {o}"
        assert o["sum"] == 3.0, (
            f"{ctx} rank {r}: all_reduce among survivors gave {o['sum']}\n{logs}"
        )
        assert o["pending_after_op"] == [victim], f"{ctx} rank {r}: {o}"
        _assert_value_error(
            ctx, r, f"recover_ranks([{r}]) (active) while a joiner waits", o["active_rank"], logs
        )

    res = rp.run(rank_api_admit, victim, timeout=REJOIN_RUN_TIMEOUT)
    expect_ok(rp, res, range(W), f"{ctx} admit")
    logs = rp.mooncake_lines()
    for r in range(W):
        o = res[r]
        assert o["epoch"] == 2 and o["active"] == [1, 1, 1], f"{ctx} rank {r}: {o}\n{logs}"
        assert o["pending"] == [], f"{ctx} rank {r}: {o}"
        assert o["sum"] == 6.0 and o["sum2"] == 6.0, f"{ctx} rank {r}: {o}\n{logs}"
        _assert_value_error(
            ctx, r, f"recover_ranks([{victim}]) after it rejoined", o["again"], logs
        )
        assert o["epoch_after"] == 2, f"{ctx} rank {r}: {o}"
    for r in survivors:
        assert res[r]["pending_before"] == [victim], f"{ctx} rank {r}: {res[r]}"


# ============================================== 3. FT-5: seats beyond the founders


def rank_ft5_founders(rank, ws):
    """Before seat 2 is filled: the founders run over {0, 1}; seat 2 only waits."""
    import mooncake_pg

    out = {"active": mooncake_pg.get_active_ranks().tolist(), "epoch": mooncake_pg.get_epoch()}
    if rank == 2:
        return out
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["sum"] = t.item()
    o = torch.full((ws * 2,), -7.0)
    dist.all_gather_into_tensor(o, torch.full((2,), float(rank)))
    out["gather"] = o.tolist()
    out["pending"] = mooncake_pg.get_pending_ranks()
    return out


def rank_ft5_join(rank, ws, joiner):
    """The joiner joins; the members admit whatever is pending between two ops."""
    import mooncake_pg

    if rank == joiner:
        mooncake_pg.join_group(None, timeout=JOIN_TIMEOUT)
    else:
        deadline = time.monotonic() + JOIN_TIMEOUT
        while True:
            t = torch.ones(1)
            dist.all_reduce(t)  # the members keep working while they wait
            pend = mooncake_pg.get_pending_ranks()
            mooncake_pg.recover_ranks(None, pend)
            if mooncake_pg.get_active_ranks()[joiner]:
                break
            assert time.monotonic() < deadline, f"rank {rank}: seat {joiner} never pending"
            time.sleep(0.005)
    return {"active": mooncake_pg.get_active_ranks().tolist(), "epoch": mooncake_pg.get_epoch()}


def rank_ft5_traffic(rank, ws):
    """FT-5: all_reduce of [rank + 1]; 1024 int32 between ranks 2 and 1 both ways, plain
    and batch_isend_irecv."""
    import mooncake_pg

    out = {"active": mooncake_pg.get_active_ranks().tolist(), "epoch": mooncake_pg.get_epoch()}
    active = [j for j, a in enumerate(out["active"]) if a]
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["sum"] = t.item()
    if rank in (1, 2) and 1 in active and 2 in active:
        peer = 3 - rank
        mine = torch.arange(1024, dtype=torch.int32) * (rank + 1) + 17
        want = torch.arange(1024, dtype=torch.int32) * (peer + 1) + 17
        got = torch.full((1024,), -1, dtype=torch.int32)
        if rank == 2:
            dist.send(mine, peer)
            dist.recv(got, peer)
        else:
            dist.recv(got, peer)
            dist.send(mine, peer)
        out["plain"] = torch.equal(got, want)
        got = torch.full((1024,), -1, dtype=torch.int32)
        reqs = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, mine + 1, peer), dist.P2POp(dist.irecv, got, peer)]
        )
        for q in reqs:
            q.wait()
        out["batch"] = torch.equal(got, want + 1)
    dist.barrier()
    return out


def rank_ft5_die(rank, ws, victim):
    if rank == victim:
        kill_self(rank, "FT-5 victim")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # mask policy: completes over the survivors
    import mooncake_pg

    return {
        "sum": t.item(),
        "active": mooncake_pg.get_active_ranks().tolist(),
        "epoch": mooncake_pg.get_epoch(),
    }


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ft5_extension_seat(rj_pool, transport):
    """CASES.md FT-5: max_group_size=3 (world size 3 everywhere), ranks 0 and 1 found the
    group, seat 2 is empty and joins later; all_reduce gives 6 and rank 2 <-> rank 1 p2p
    arrives intact both ways; then rank 1 is killed and brought back into its seat."""
    rp = rj_pool(
        transport,
        options={"max_group_size": W, "active_ranks": [0, 1]},
        rank_options={2: {"is_recovery": True}},
    )
    res = rp.run(rank_ft5_founders)
    expect_ok(rp, res, range(W), "founders")
    for r in (0, 1):
        assert res[r]["active"] == [1, 1, 0] and res[r]["epoch"] == 0, res[r]
        assert res[r]["sum"] == 3.0, f"rank {r}: all_reduce over the founders gave {res[r]['sum']}"
        # the empty seat's slot of all_gather stays untouched
        assert res[r]["gather"] == [0.0, 0.0, 1.0, 1.0, -7.0, -7.0], res[r]["gather"]
        assert res[r]["pending"] == [2], f"rank {r}: pending {res[r]['pending']}"
    res = rp.run(rank_ft5_join, 2, timeout=REJOIN_RUN_TIMEOUT)
    expect_ok(rp, res, range(W), "seat 2 joins")
    assert all(res[r] == {"active": [1, 1, 1], "epoch": 1} for r in range(W)), res
    epoch = 1
    for cycle in range(2):
        ctx = f"[{transport} cycle {cycle}]"
        res = rp.run(rank_ft5_traffic)
        expect_ok(rp, res, range(W), f"{ctx} traffic")
        for r in range(W):
            assert res[r]["active"] == [1, 1, 1] and res[r]["epoch"] == epoch, f"{ctx} {res[r]}"
            assert res[r]["sum"] == 6.0, f"{ctx} rank {r}: all_reduce gave {res[r]['sum']}"
        for r in (1, 2):
            assert res[r]["plain"] and res[r]["batch"], (
                f"{ctx} rank {r}: p2p with the other: {res[r]}"
            )
        # kill rank 1, the others go on without it, then it comes back into its seat
        res = rp.run(rank_ft5_die, 1)
        expect_died(rp, res, 1, ctx)
        expect_ok(rp, res, (0, 2), ctx)
        for r in (0, 2):
            assert res[r] == {"sum": 4.0, "active": [1, 0, 1], "epoch": epoch + 1}, (
                f"{ctx} rank {r}: {res[r]}"
            )
        rp.respawn(1)
        res = rp.run(rank_ft5_join, 1, timeout=REJOIN_RUN_TIMEOUT)
        expect_ok(rp, res, range(W), f"{ctx} rank 1 rejoins")
        epoch += 2
        assert all(res[r] == {"active": [1, 1, 1], "epoch": epoch} for r in range(W)), res
    res = rp.run(rank_ft5_traffic)
    expect_ok(rp, res, range(W), "after the cycles")
    assert all(res[r]["sum"] == 6.0 for r in range(W)) and res[1]["plain"] and res[2]["batch"], res


def rank_ft5_sub_before(rank, ws):
    """Every process creates subgroup [1, 2] while seat 2 is empty: rank 1 sets it up
    alone (seat 2 inactive), the joiner creates it as a joiner (its default group is
    still joining)."""
    import mooncake_pg

    g = dist.new_group([1, 2])
    _ST["sub"] = g
    if rank == 1:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=g)
        return {"sum": t.item(), "active": mooncake_pg.get_active_ranks(g).tolist()}
    return {}


def rank_ft5_sub_join(rank, ws):
    """After the default group: seat 2 joins subgroup [1, 2]; then every process creates a
    new group [0, 1, 2], set up normally (nobody is joining any more)."""
    import mooncake_pg

    g = _ST["sub"]
    out = {}
    if rank == 2:
        mooncake_pg.join_group(g, timeout=JOIN_TIMEOUT)
    elif rank == 1:
        deadline = time.monotonic() + JOIN_TIMEOUT
        while not mooncake_pg.get_pending_ranks(g):
            assert time.monotonic() < deadline, "seat 2 never asked to join the subgroup"
            time.sleep(0.005)
        mooncake_pg.recover_ranks(g, mooncake_pg.get_pending_ranks(g))
    if rank in (1, 2):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=g)
        out["sub_sum"] = t.item()
        out["sub_active"] = mooncake_pg.get_active_ranks(g).tolist()
    g2 = dist.new_group([0, 1, 2])
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=g2)
    out["new_sum"] = t.item()
    out["new_active"] = mooncake_pg.get_active_ranks(g2).tolist()
    return out


def test_ft5_extension_seat_subgroups(rj_pool):
    """A subgroup created while a seat is empty is joined by the process that fills the
    seat (after the default group); groups created after the join are set up normally."""
    rp = rj_pool(
        "shm",
        options={"max_group_size": W, "active_ranks": [0, 1]},
        rank_options={2: {"is_recovery": True}},
    )
    res = rp.run(rank_ft5_sub_before)
    expect_ok(rp, res, range(W), "subgroup before the join")
    assert res[1] == {"sum": 2.0, "active": [1, 0]}, res[1]
    res = rp.run(rank_ft5_join, 2, timeout=REJOIN_RUN_TIMEOUT)
    expect_ok(rp, res, range(W), "seat 2 joins")
    res = rp.run(rank_ft5_sub_join, timeout=REJOIN_RUN_TIMEOUT)
    expect_ok(rp, res, range(W), "subgroups after the join")
    for r in (1, 2):
        assert res[r]["sub_sum"] == 5.0 and res[r]["sub_active"] == [1, 1], f"rank {r}: {res[r]}"
    for r in range(W):
        assert res[r]["new_sum"] == 6.0 and res[r]["new_active"] == [1, 1, 1], f"rank {r}: {res[r]}"


def rank_pending_probe(rank, ws, joiner=None, joiner_pid=None):
    """The registered joiner dies; the members look for pending ranks once it is gone."""
    import mooncake_pg

    if rank == joiner:
        kill_self(rank, "joiner dies before join_group")
    if joiner_pid:
        wait_dead(joiner_pid, 10.0)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    pend = mooncake_pg.get_pending_ranks()
    admitted = mooncake_pg.recover_ranks(None, pend)
    return {
        "pending": pend,
        "admitted": admitted,
        "sum": t.item(),
        "active": mooncake_pg.get_active_ranks().tolist(),
    }


def test_joiner_dying_before_admission_is_not_pending(rj_pool):
    """A replacement that registered (is_recovery init) and died before it was admitted is
    not reported pending on its host, so recover_ranks never waits for it; a second
    replacement for the same seat then joins normally."""
    rp = rj_pool("shm")
    expect_ok(rp, rp.run(rank_setup, "sgd"), range(W), "setup")
    res = rp.run(rank_train, 3, 1, 1)
    expect_died(rp, res, 1, "kill")
    pid = rp.respawn(1)
    res = rp.run(rank_pending_probe, 1, pid)
    expect_died(rp, res, 1, "dead joiner")
    for r in (0, 2):
        assert res[r] == {"pending": [], "admitted": [], "sum": 4.0, "active": [1, 0, 1]}, (
            f"rank {r}: {res[r]}"
        )
    rp.respawn(1)
    res = rp.run(rank_rejoin, 1, {"step": 0, "kind": "sgd"}, timeout=REJOIN_RUN_TIMEOUT)
    expect_ok(rp, res, range(W), "second replacement")
    assert all(res[r]["active"] == [1, 1, 1] and res[r]["epoch"] == 2 for r in range(W)), res


def test_mismatched_replacement_is_rejected_at_init(rj_pool):
    """A replacement whose settings differ from the group's (here shm_slot_bytes) raises
    ValueError from its init_process_group, before it asks to join; the survivors never
    see it pending and a matching replacement then joins."""
    rp = rj_pool("shm")
    expect_ok(rp, rp.run(rank_setup, "sgd"), range(W), "setup")
    res = rp.run(rank_train, 2, 1, 1)
    expect_died(rp, res, 1, "kill")
    with pytest.raises(AssertionError, match="does not match the group"):
        rp.respawn(1, extra_env={"MOONCAKE_SHM_SLOT_BYTES": "65536"})


def rank_joiner_dies_in_recover(rank, ws, joiner):
    """The joiner dies after the survivors saw it pending, before it takes part in the
    transport rebuild; the survivors' recover_ranks records it failed, rebuilds without it
    and returns no admitted rank; the group goes on."""
    import mooncake_pg

    if rank == joiner:
        time.sleep(0.5)
        kill_self(rank, "joiner dies during the survivors' recover_ranks")
    pend = []
    deadline = time.monotonic() + 10
    while not pend and time.monotonic() < deadline:
        pend = mooncake_pg.get_pending_ranks()
        time.sleep(0.01)
    t0 = time.monotonic()
    err = None
    try:
        admitted = mooncake_pg.recover_ranks(None, pend)
    except Exception as e:
        admitted, err = None, f"{type(e).__name__}: {e}"
    dt = time.monotonic() - t0
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {
        "pending": pend,
        "admitted": admitted,
        "err": err,
        "dt": dt,
        "sum": t.item(),
        "active": mooncake_pg.get_active_ranks().tolist(),
        "epoch": mooncake_pg.get_epoch(),
    }


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_joiner_dying_during_recover_ranks(rj_pool, transport):
    rp = rj_pool(transport, op_timeout=3.0)
    expect_ok(rp, rp.run(rank_setup, "sgd"), range(W), "setup")
    res = rp.run(rank_train, 2, 1, 1)
    expect_died(rp, res, 1, "kill")
    rp.respawn(1)
    res = rp.run(rank_joiner_dies_in_recover, 1)
    expect_died(rp, res, 1, "joiner")
    expect_ok(rp, res, (0, 2), "survivors")
    for r in (0, 2):
        o = res[r]
        assert o["pending"] == [1] and o["err"] is None and o["admitted"] == [], (
            f"rank {r}: {o}\n{rp.mooncake_lines()}"
        )
        assert o["sum"] == 4.0 and o["active"] == [1, 0, 1] and o["epoch"] == 3, f"rank {r}: {o}"
        assert o["dt"] < 15, f"rank {r}: recover_ranks took {o['dt']:.1f} s"
    # and a further replacement joins normally
    rp.respawn(1)
    res = rp.run(rank_rejoin, 1, {"step": 0, "kind": "sgd"}, timeout=REJOIN_RUN_TIMEOUT)
    expect_ok(rp, res, range(W), "second replacement")
    assert all(res[r]["active"] == [1, 1, 1] and res[r]["epoch"] == 4 for r in range(W)), res


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


def test_options_of_the_wrong_type_raise_at_construction():
    """MooncakeOptions names the field of a value of the wrong type when it is made (a
    string timeout failed inside float(), a string flag was taken at init_process_group)."""
    import mooncake_pg

    cases = [
        (dict(timeout="abc"), "timeout must be seconds"),
        (dict(timeout=None), "timeout must be seconds"),
        (dict(timeout=True), "timeout must be seconds"),
        (dict(max_group_size="4"), "max_group_size must be an int, got '4'"),
        (dict(shm_slot_bytes=8192.0), "shm_slot_bytes must be an int"),
        (dict(active_ranks="0,1"), "active_ranks must be a sequence of int seat numbers"),
        (dict(active_ranks=[0.5]), "active_ranks must be a sequence of int seat numbers"),
        (dict(debug="0"), "MooncakeOptions.debug must be True or False"),
        (dict(is_recovery="yes"), "MooncakeOptions.is_recovery must be True or False"),
        (dict(cuda_ipc="false"), "MooncakeOptions.cuda_ipc must be True or False"),
    ]
    for kw, want in cases:
        with pytest.raises(ValueError, match=want):
            mooncake_pg.MooncakeOptions(**kw)
    o = mooncake_pg.MooncakeOptions(timeout=5, max_group_size=4, active_ranks=(1, 0), debug=1)
    assert (o.timeout, o.max_group_size, o.active_ranks, o.debug) == (5, 4, [0, 1], True)


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


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_active_ranks_that_differ_raise_at_init_without_waiting_for_the_store_timeout():
    """Seat 0 is a recovering process; rank 1 founds the group with active_ranks [0, 1, 2]
    (so it waits for seat 0, which never comes), rank 2 with [1, 2]. Both founders raise
    ValueError naming active_ranks within seconds, not after the 60 s store timeout."""
    t0 = time.monotonic()
    with pytest.raises(PoolStartError) as ei:
        pool = RankPool(
            3,
            "mooncake",
            "shm",
            op_timeout=60.0,
            options={"max_group_size": 3, "active_ranks": [1, 2]},
            rank_options={0: {"is_recovery": True}, 1: {"active_ranks": [0, 1, 2]}},
        )
        pool.close(graceful=False)
    errs = ei.value.errors
    for r in (1, 2):
        e = errs[r]
        assert e.isinstance_of("ValueError") and "active_ranks must agree" in e.message, (
            f"rank {r}: {e!r}"
        )
        assert "members=0,1,2" in e.message and "members=1,2" in e.message, e.message
    assert time.monotonic() - t0 < 45, f"took {time.monotonic() - t0:.1f} s"


@pytest.mark.timeout(60)
def test_a_recovering_process_in_a_founders_seat_is_refused_on_both_sides():
    """Seat 0 starts with is_recovery=True while ranks 1 and 2 found the group with every
    seat active (so they wait for seat 0's records, and seat 0 waits for a group to join).
    All three raise ValueError naming the misuse within seconds, not after the 60 s store
    timeout."""
    t0 = time.monotonic()
    with pytest.raises(PoolStartError) as ei:
        pool = RankPool(
            3,
            "mooncake",
            "shm",
            op_timeout=60.0,
            options={"max_group_size": 3},
            rank_options={0: {"is_recovery": True}},
        )
        pool.close(graceful=False)
    errs = ei.value.errors
    assert sorted(errs) == [0, 1, 2], f"{ei.value}"
    for r, e in errs.items():
        assert e.isinstance_of("ValueError"), f"rank {r}: {e!r}"
        assert "rank 0 started with is_recovery=True" in e.message, f"rank {r}: {e.message}"
    assert time.monotonic() - t0 < 30, f"took {time.monotonic() - t0:.1f} s"
