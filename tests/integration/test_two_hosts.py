"""Two hosts in network namespaces: ranks 0-1 on host a, ranks 2-3 on host b,
one ``mooncake-run`` per host (node 0's, on a, hosts the control store), TCP between the
hosts (``MOONCAKE_HOST_ID`` differs, so the transport follows the namespaces). Host b is
then cut off (its bridge port drops every frame: no RST, no ICMP, TCP just stalls).

Expected: both sides detect the cut within a few op timeouts; a, which reaches the
control store, agrees that 2 and 3 failed and goes on (all_reduce of [rank + 1] gives 3);
b's ranks cannot reach the store, fence themselves with ``RankFencedError`` naming the
unreachable store, and exit; nothing hangs. Traffic stays on 10.213.0.0/24 inside
namespaces this test creates (tests/netns.py), which are deleted afterwards.
Skipped where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import time

import pytest

from tests import REPO_ROOT, netns
from tests.faults import kill_group

ROOT = REPO_ROOT
OK, WHY = netns.available()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not OK, reason=f"network namespaces: {WHY}"),
]

OP_TIMEOUT = 3.0
RANK_SCRIPT = r'''
import json, os, sys, time
import torch, torch.distributed as dist, mooncake_pg
dist.init_process_group("mooncake", pg_options=mooncake_pg.MooncakeOptions(on_failure="mask", timeout=%(timeout)s))
rank = dist.get_rank()
progress = os.path.join(os.environ["PROGRESS_DIR"], str(rank))
sums, t_cut = [], None
try:
    while True:
        t = torch.tensor([float(rank + 1)])
        t0 = time.monotonic()
        dist.all_reduce(t)
        if time.monotonic() - t0 > 1.0 and t_cut is None:
            t_cut = time.monotonic() - t0
        sums.append(t.item())
        with open(progress, "w") as f:
            f.write(str(len(sums)))
        if len(sums) > 20 and sums[-1] == 3.0 and sums.count(3.0) >= 20:
            break
        time.sleep(0.02)
    out = {"rank": rank, "ok": True, "sums": sums[-25:], "first": sums[0], "stall": t_cut,
           "active": mooncake_pg.get_active_ranks().tolist(), "epoch": mooncake_pg.get_epoch()}
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
except Exception as e:
    out = {"rank": rank, "ok": False, "type": type(e).__name__, "msg": str(e)[:600], "n": len(sums),
           "is_dist_error": isinstance(e, dist.DistBackendError)}
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(3)
'''


def _results(log_dir):
    """RESULT records of the ranks' stdout files (mooncake-run --log-dir)."""
    out = {}
    for name in sorted(os.listdir(log_dir)):
        if name.endswith(".out"):
            with open(os.path.join(log_dir, name)) as f:
                for line in f:
                    if line.startswith("RESULT "):
                        rec = json.loads(line[7:])
                        out[rec["rank"]] = rec
    return out


def _launch_nodes(t, tmp_path, argv, extra_env=None):
    """One ``mooncake-run --nnodes 2 --nproc-per-node 2`` per host (node 0 on t.a hosts the
    control store), ranks' output under tmp_path/ranks<node>, the launcher's in
    tmp_path/node<node>.log. Returns {node: (Popen, log file)}."""
    port = random.randint(20000, 60000)  # any port: the namespace and its addresses are ours alone
    launchers = {}
    for node, ns in ((0, t.a), (1, t.b)):
        env = dict(os.environ)
        env.update(
            {
                "MOONCAKE_HOST_ID": f"host-{node}",
                "MOONCAKE_SOCKET_IFNAME": "eth0",
                "GLOO_SOCKET_IFNAME": "eth0",
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
                **(extra_env or {}),
            }
        )
        log = open(tmp_path / f"node{node}.log", "w")
        launchers[node] = (
            netns.run_in(
                ns,
                [
                    sys.executable,
                    "-m",
                    "mooncake_pg.run",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(node),
                    "--master-addr",
                    t.addr[t.a],
                    "--master-port",
                    str(port),
                    "--nproc-per-node",
                    "2",
                    "--log-dir",
                    str(tmp_path / f"ranks{node}"),
                    *argv,
                ],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=log,
            ),
            log,
        )
    return launchers


def _logs(tmp_path):
    text = []
    for n in (0, 1):
        text.append(f"--- launcher {n}:\n" + (tmp_path / f"node{n}.log").read_text()[-3000:])
        d = tmp_path / f"ranks{n}"
        for name in sorted(os.listdir(d)) if d.exists() else []:
            text.append(f"--- {name}:\n" + (d / name).read_text()[-2000:])
    return "\n".join(text)


def test_cut_off_host_fences_itself_and_the_store_side_goes_on(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT % {"timeout": OP_TIMEOUT})
    progress = tmp_path / "progress"
    progress.mkdir()
    with netns.two_hosts("mctest") as t:
        launchers = _launch_nodes(
            t, tmp_path, ["--max-restarts", "0", str(script)], {"PROGRESS_DIR": str(progress)}
        )

        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                done = [int((progress / r).read_text() or 0) for r in os.listdir(progress)]
                if len(done) == 4 and min(done) >= 10:
                    break
                assert all(p.poll() is None for p, _ in launchers.values()), (
                    f"a launcher exited early\n{_logs(tmp_path)}"
                )
                time.sleep(0.1)
            else:
                raise AssertionError(f"the 4 ranks did not get going\n{_logs(tmp_path)}")
            t_cut = time.monotonic()
            netns.cut(t, t.b)
            rcs = {}
            for node, (p, _) in launchers.items():
                try:
                    rcs[node] = p.wait(max(1.0, t_cut + 60 - time.monotonic()))
                except Exception:
                    rcs[node] = None
            took = time.monotonic() - t_cut
        finally:
            for p, log in launchers.values():
                kill_group(p, wait_s=10)
                log.close()
    assert rcs == {0: 0, 1: 1}, (
        f"launcher exit codes {rcs} (a should finish, b's ranks fail)\n{_logs(tmp_path)}"
    )
    assert took < 60, f"took {took:.1f} s\n{_logs(tmp_path)}"
    res = {}
    for n in (0, 1):
        res.update(_results(tmp_path / f"ranks{n}"))
    assert sorted(res) == [0, 1, 2, 3], f"results {res}\n{_logs(tmp_path)}"
    for r in (0, 1):
        o = res[r]
        assert o["ok"] and o["first"] == 10.0, f"rank {r}: {o}\n{_logs(tmp_path)}"
        # 2 and 3 are agreed failed together (epoch 1) or one after the other (epoch 2)
        assert o["active"] == [1, 1, 0, 0] and o["epoch"] in (1, 2), f"rank {r}: {o}"
        assert o["epoch"] == res[0]["epoch"], f"ranks 0 and 1 end in different epochs: {res[0]} {o}"
        assert set(o["sums"]) <= {10.0, 3.0} and o["sums"][-1] == 3.0, f"rank {r}: {o}"
        assert o["stall"] is not None and o["stall"] < 4 * OP_TIMEOUT, (
            f"rank {r}: detection took {o['stall']}"
        )
    for r in (2, 3):
        o = res[r]
        assert not o["ok"] and o["type"] == "RankFencedError" and o["is_dist_error"], (
            f"rank {r}: {o}\n{_logs(tmp_path)}"
        )
        assert "control store is unreachable" in o["msg"] and "fences itself" in o["msg"], (
            f"rank {r}: {o['msg']}"
        )
    print(f"cut detected and settled in {took:.1f} s; a's stall {res[0]['stall']:.2f} s")


@pytest.mark.parametrize("victim", [2, 1])
def test_a_rank_respawned_on_its_host_rejoins_its_seat(tmp_path, victim):
    """``examples/elastic_train.py`` over two hosts of two ranks, one ``mooncake-run`` per
    host: the victim (on host b, or on host a beside the control store) SIGKILLs itself at
    step 20; the other three go on over the flat path (2 + 1 ranks), its host's launcher
    respawns it there, it rejoins its seat with ``sync_state``, and the two-level path
    (the 41 KiB gradient of ``--hidden 256``) carries the rest. The run ends with 4 active
    ranks and bit-identical parameters, loss down."""
    argv = ["--max-restarts", "1", os.path.join(ROOT, "examples", "elastic_train.py")]
    argv += ["--steps", "90", "--kill-rank", str(victim), "--kill-at", "20"]
    argv += ["--step-time", "0.03", "--hidden", "256"]
    with netns.two_hosts("mctest") as t:
        launchers = _launch_nodes(t, tmp_path, argv)
        rcs = {}
        try:
            for node, (p, _) in launchers.items():
                try:
                    rcs[node] = p.wait(180)
                except Exception:
                    rcs[node] = None
        finally:
            for p, log in launchers.values():
                kill_group(p, wait_s=10)
                log.close()
    ctx = _logs(tmp_path)
    assert rcs == {0: 0, 1: 0}, f"launcher exit codes {rcs}\n{ctx}"
    node = victim // 2
    launcher = (tmp_path / f"node{node}.log").read_text()
    assert f"rank {victim} died (signal SIGKILL); respawning it alone" in launcher, ctx
    assert "finished: all 2 ranks exited 0 (1 restarts)" in launcher, ctx
    ranks = {
        n: "".join(p.read_text() for p in sorted((tmp_path / f"ranks{n}").glob("*.out")))
        for n in (0, 1)
    }
    assert f"[rank {victim}] respawned: waiting to be admitted" in ranks[node], ctx
    done = re.search(
        r"done: (\d+) steps .* loss ([\d.]+) -> ([\d.]+), (\d+) recoveries, epoch (\d+), "
        r"active \[1, 1, 1, 1\], parameters identical on all ranks: True",
        ranks[0],
    )
    assert done, ctx
    steps, first, last, recov, epoch = done.groups()
    assert int(steps) == 90 and float(last) < 0.5 * float(first), ctx
    assert int(recov) == 1 and int(epoch) == 2, ctx
    assert "over 3 ranks" in ranks[0], ctx
