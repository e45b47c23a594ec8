"""``mooncake-run`` (``python -m mooncake_pg.run``): the launcher that hosts the control
store and respawns only a dead rank.

Every launcher runs in its own process session and is killed as a group at teardown (the
ranks die with it: they run in sessions of their own with ``PR_SET_PDEATHSIG``, and the
launcher's SIGTERM handler stops them). Ranks talk over loopback only.

1. ``examples/elastic_train.py`` on 4 ranks: rank 1 (and, in a second run, rank 0, whose
   death takes no store with it) SIGKILLs itself mid-training; the others go on, the
   launcher respawns it, it rejoins with ``sync_state``; the run ends with 4 ranks and
   identical parameters, and the loss went down (the README's example).
2. A rank that keeps failing is respawned ``--max-restarts`` times, then the launcher
   exits 1 once the others are done.
3. SIGTERM to the launcher stops every rank; the control store listens on 127.0.0.1 only.
4. ``--max-group-size`` beyond the started ranks: extension seats start empty and nobody
   waits for them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests import REPO_ROOT
from tests.faults import (
    alive,  # a zombie nobody reaped counts as dead
    kill_group,
)

ROOT = REPO_ROOT
PY = sys.executable


def _launch(args, tmp_path, env=None):
    e = dict(os.environ)
    e.update({"MOONCAKE_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    e.update(env or {})
    out = open(tmp_path / "launcher.out", "w+")
    p = subprocess.Popen(
        [PY, "-m", "mooncake_pg.run", *args],
        cwd=ROOT,
        env=e,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    p.out = out
    return p


def _finish(p, timeout):
    try:
        rc = p.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        kill_group(p)
    p.out.seek(0)
    text = p.out.read()
    assert rc is not None, f"mooncake-run did not finish within {timeout} s:\n{text[-6000:]}"
    return rc, text


@pytest.mark.slow(unless={"victim": [1]})
@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", [1, 0])
def test_elastic_train_survives_a_killed_rank(tmp_path, victim):
    p = _launch(
        [
            "--nproc-per-node",
            "4",
            "--max-restarts",
            "2",
            "examples/elastic_train.py",
            "--steps",
            "90",
            "--kill-rank",
            str(victim),
            "--kill-at",
            "20",
            "--step-time",
            "0.03",
        ],
        tmp_path,
    )
    rc, text = _finish(p, 200)
    ctx = f"victim {victim}:\n{text[-6000:]}"
    assert rc == 0, ctx
    assert f"rank {victim} died (signal SIGKILL); respawning it alone" in text, ctx
    assert f"[rank {victim}] respawned: waiting to be admitted" in text, ctx
    done = re.search(
        r"done: (\d+) steps .* loss ([\d.]+) -> ([\d.]+), (\d+) recoveries, epoch (\d+), "
        r"active \[1, 1, 1, 1\], parameters identical on all ranks: True",
        text,
    )
    assert done, ctx
    steps, first, last, recov, epoch = done.groups()
    assert int(steps) == 90 and float(last) < 0.5 * float(first), ctx
    assert int(recov) == 1 and int(epoch) == 2, ctx
    assert "finished: all 4 ranks exited 0 (1 restarts)" in text, ctx
    # survivors went on over 3 ranks while the victim was away
    assert "over 3 ranks" in text, ctx


FAILING = """
import os, sys
with open(os.environ["COUNT_FILE"], "a") as f:
    f.write(os.environ["RANK"] + ":" + os.environ["TORCHELASTIC_RESTART_COUNT"] + ":"
            + os.environ["MOONCAKE_IS_RECOVERY"] + "\\n")
sys.exit(3 if os.environ["RANK"] == "1" else 0)
"""


@pytest.mark.timeout(120)
def test_max_restarts_then_exit_1(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    count = tmp_path / "count"
    p = _launch(
        ["--nproc-per-node", "2", "--max-restarts", "2", "--monitor-interval", "0.05", str(script)],
        tmp_path,
        env={"COUNT_FILE": str(count)},
    )
    rc, text = _finish(p, 90)
    assert rc == 1, text
    starts = sorted(count.read_text().split())
    # rank 0 once; rank 1 three times (first start + 2 restarts), the respawns as recovery
    assert starts == ["0:0:0", "1:0:0", "1:1:1", "1:2:1"], f"{starts}\n{text}"
    assert "rank 1 died (exit code 3) after 2 restarts; not respawned" in text, text
    assert "ranks [1] failed for good; exit 1" in text, text


SLEEPER = """
import os, time
with open(os.path.join(os.environ["PID_DIR"], os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
"""


@pytest.mark.timeout(120)
def test_sigterm_stops_every_rank_and_store_is_loopback_only(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    pids = tmp_path / "pids"
    pids.mkdir()
    p = _launch(
        ["--nproc-per-node", "3", "--shutdown-grace", "2", str(script)],
        tmp_path,
        env={"PID_DIR": str(pids)},
    )
    deadline = time.monotonic() + 60
    while len(os.listdir(pids)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    ranks = [int((pids / r).read_text() or 0) for r in sorted(os.listdir(pids))]
    p.out.seek(0)
    m = re.search(r"control store on 127\.0\.0\.1:(\d+)", p.out.read())
    assert m and len(ranks) == 3, "launcher did not start 3 ranks"
    port = int(m.group(1))
    # the store's listening socket: 127.0.0.1 only (0100007F in /proc/net/tcp)
    listeners = []
    for line in (
        open("/proc/net/tcp").read().splitlines()[1:]
        + open("/proc/net/tcp6").read().splitlines()[1:]
    ):
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
            listeners.append(local.rsplit(":", 1)[0])
    assert listeners == ["0100007F"], f"control store listens on {listeners}"
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    rc, text = _finish(p, 30)
    assert rc == 128 + signal.SIGTERM, text
    while any(alive(pid) for pid in ranks) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in ranks), f"ranks still alive after SIGTERM: {ranks}\n{text}"


EXTENSION = """
import os, torch, torch.distributed as dist, mooncake_pg
dist.init_process_group("mooncake")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} world {dist.get_world_size()} sum {t.item()} "
      f"active {mooncake_pg.get_active_ranks().tolist()} env {os.environ['MOONCAKE_ACTIVE_RANKS']}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_extension_seats_start_empty(tmp_path):
    script = tmp_path / "ext.py"
    script.write_text(EXTENSION)
    p = _launch(["--nproc-per-node", "2", "--max-group-size", "3", str(script)], tmp_path)
    rc, text = _finish(p, 90)
    assert rc == 0, text
    for r in (0, 1):
        assert f"rank {r} world 3 sum 3.0 active [1, 1, 0] env 0,1" in text, text


def test_bad_flags_are_rejected():
    for args, want in (
        (["--nnodes", "2", "x.py"], "--master-port is required"),
        (["--node-rank", "1", "x.py"], "--node-rank must lie in"),
        (["--nproc-per-node", "4", "--max-group-size", "2", "x.py"], "--max-group-size"),
    ):
        r = subprocess.run(
            [PY, "-m", "mooncake_pg.run", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and want in r.stderr, (args, r.stderr)


SIDE = """
import os, sys
from datetime import timedelta
import torch.distributed as dist
st = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                   timeout=timedelta(seconds=30))
st.set("sidecar/" + os.environ["SIDECAR_INDEX"], "here")
print("sidecar", os.environ["SIDECAR_INDEX"], "RANK" in os.environ, flush=True)
sys.exit(int(sys.argv[1]))
"""

RANK_WAITS = """
import os
from datetime import timedelta
import torch.distributed as dist
st = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                   timeout=timedelta(seconds=30))
st.wait(["sidecar/0", "sidecar/1"])
print("rank", os.environ["RANK"], "saw both sidecars", flush=True)
"""


@pytest.mark.slow(unless={"second_rc": [0]})
@pytest.mark.timeout(120)
@pytest.mark.parametrize("second_rc", [0, 5])
def test_sidecars_run_outside_the_group(tmp_path, second_rc):
    """--sidecar processes reach the control store, get no RANK, are not respawned; a
    non-zero exit fails the run."""
    (tmp_path / "side.py").write_text(SIDE)
    (tmp_path / "rank.py").write_text(RANK_WAITS)
    logs = tmp_path / "logs"
    p = _launch(
        [
            "--nproc-per-node",
            "2",
            "--log-dir",
            str(logs),
            "--sidecar",
            f"{PY} {tmp_path / 'side.py'} 0",
            "--sidecar",
            f"{PY} {tmp_path / 'side.py'} {second_rc}",
            str(tmp_path / "rank.py"),
        ],
        tmp_path,
    )
    rc, text = _finish(p, 90)
    outs = {f.name: f.read_text() for f in logs.iterdir()}  # one file per process: no interleaving
    assert (
        "sidecar 0 False" in outs["sidecar0.out"] and "sidecar 1 False" in outs["sidecar1.out"]
    ), (outs, text)
    assert (
        "rank 0 saw both sidecars" in outs["rank0.0.out"]
        and "rank 1 saw both sidecars" in outs["rank1.0.out"]
    ), outs
    if second_rc == 0:
        assert rc == 0, text
    else:
        assert rc == 1 and "sidecars [1] failed for good" in text, text


ALL_DIE = """
import os, sys, torch, torch.distributed as dist, mooncake_pg
dist.init_process_group("mooncake", pg_options=mooncake_pg.MooncakeOptions(on_failure="mask", timeout=5))
if mooncake_pg.is_joining():
    try:
        mooncake_pg.join_group(timeout=60)
    except Exception as e:
        print("JOIN-FAILED", type(e).__name__, str(e)[:300], flush=True)
        sys.exit(4)
    print("JOINED?!", flush=True)
    sys.exit(0)
dist.barrier()
sys.exit(3)      # every rank fails the same way
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_joiners_fail_fast_when_every_rank_died(tmp_path):
    """Every rank dies; the respawned ones find no live member to admit them and fail at
    once (not after join_group's timeout), so the launcher gives up quickly."""
    (tmp_path / "all_die.py").write_text(ALL_DIE)
    t0 = time.monotonic()
    p = _launch(
        ["--nproc-per-node", "2", "--max-restarts", "1", str(tmp_path / "all_die.py")], tmp_path
    )
    rc, text = _finish(p, 100)
    took = time.monotonic() - t0
    assert rc == 1, text
    # (the two ranks print at once into one stream: their lines may interleave)
    assert text.count("JOIN-FAILED") == 2 and text.count("no live member is left") == 2, text
    assert took < 50, f"took {took:.1f} s\n{text}"
