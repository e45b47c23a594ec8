"""Two serving processes on two emulated hosts share one KV cache, and one of them dies.

Host 0 runs the master and serving process A, host 1 serving process B (tests/netns.py:
network namespaces joined by a bridge; processes in tests/store/kv_host_agent.py). A puts
the K/V of several prompts; B hits them over the link, with A's bytes. Then A is
SIGKILLed: with two replicas (spread over the hosts) B still hits every prompt; with one, B
gets misses (never wrong K/V, never a get slower than ``GET_BOUND_S``) and ``explain``
says ``holder_lost``. See docs/kv-cache.md "Across hosts".
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import pytest

from tests import REPO_ROOT, netns
from tests.faults import kill_group

OK, WHY = netns.available()
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not OK, reason=f"network namespaces: {WHY}"),
]

CLIENT_TTL_S = 1.0  # the master declares a client dead after this long without a heartbeat
GET_BOUND_S = 10.0  # no get may wait longer than this on the dead holder
PROMPTS = 8


def _env(host: int) -> dict:
    env = dict(os.environ)
    env.update(
        {
            "MOONCAKE_HOST_ID": f"host-{host}",
            "MOONCAKE_SOCKET_IFNAME": "eth0",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
        }
    )
    return env


def _wait(path: str, procs: list, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        for p in procs:
            assert p.poll() is None, f"a process exited ({p.args[-4:]}) before {path}"
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        time.sleep(0.05)


def _pass(d: str, n: int, procs: list, during=None) -> list:
    """B's reads of pass ``n``: one round of the prompts, or rounds while ``during()`` runs."""
    with open(os.path.join(d, f"go{n}"), "w") as f:
        f.write("loop" if during else "")
    if during:
        during()
        open(os.path.join(d, f"end{n}"), "w").close()
    _wait(os.path.join(d, f"pass{n}.json"), procs)
    with open(os.path.join(d, f"pass{n}.json")) as f:
        return json.load(f)


def _hit_rate(rows: list) -> float:
    return sum(r["got"] for r in rows) / sum(r["len"] for r in rows)


@pytest.mark.parametrize("replicas", [2, 1])
def test_reuse_across_hosts_survives_a_dead_holder(tmp_path, replicas):
    d = str(tmp_path)
    rng = random.Random(replicas)
    # prompts share a common system prefix, as a serving instance's would
    head = [rng.randrange(1000) for _ in range(32)]
    prompts = [
        head + [rng.randrange(1000) for _ in range(16 * (1 + i % 3))] for i in range(PROMPTS)
    ]
    with open(os.path.join(d, "prompts.json"), "w") as f:
        json.dump(prompts, f)
    port = random.randint(20000, 60000)  # the namespaces and their addresses are ours alone
    procs: list = []
    logs: list = []

    def start(host_ns: str, host: int, argv: list, name: str):
        log = open(os.path.join(d, f"{name}.log"), "w")
        logs.append(log)
        p = netns.run_in(
            host_ns, argv, env=_env(host), stdout=log, stderr=log, start_new_session=True
        )
        procs.append(p)
        return p

    with netns.two_hosts("mckvh") as t:
        master = f"{t.addr[t.a]}:{port}"
        try:
            start(
                t.a,
                0,
                [
                    sys.executable,
                    "-m",
                    "mooncake_store.master",
                    "--host",
                    t.addr[t.a],
                    "--port",
                    str(port),
                    "--client-ttl",
                    str(CLIENT_TTL_S),
                ],
                "master",
            )
            agent = [sys.executable, "-m", "tests.store.kv_host_agent"]
            # B first: its segment must be registered when A puts, to take the second replicas
            b = start(t.b, 1, [*agent, "reader", master, d, str(replicas)], "b")
            _wait(os.path.join(d, "reader.ready"), procs)
            a = start(t.a, 0, [*agent, "writer", master, d, str(replicas)], "a")
            _wait(os.path.join(d, "writer.ready"), procs)

            before = _pass(d, 0, procs)
            assert all(r["ok"] for r in before), before
            assert all(r["got"] == r["len"] == r["matched"] for r in before), before
            hit_before = _hit_rate(before)
            chunks = [h for r in before for h in r["holders"]]
            want = [["reader", "writer"]] if replicas == 2 else [["writer"]]
            # one replica per host with two; the writer's alone with one
            assert all(h in want for h in chunks), chunks

            killed = []

            def kill_mid_replay():
                time.sleep(1.0)
                killed.append(time.monotonic())
                kill_group(a, wait_s=5)
                procs.remove(a)
                time.sleep(CLIENT_TTL_S * 3)

            # B replays round and round while A dies: reads in flight, reads before the
            # master notices (at_once) and after
            replay = _pass(d, 1, procs, during=kill_mid_replay)
            # a read that ended before the kill began saw A alive; one still running when it
            # began may miss (1 replica) and counts with the reads after
            mid = [r for r in replay if r["t"] + r["s"] < killed[0]]
            at_once = [r for r in replay if r["t"] + r["s"] >= killed[0]]
            assert mid and at_once, len(replay)
            assert _hit_rate(mid) == hit_before, mid
            after = _pass(d, 2, procs)
            for rows in (at_once, after):
                assert all(r["ok"] for r in rows), rows
                assert all(r["s"] < GET_BOUND_S for r in rows), rows
            hit_after = _hit_rate(after)
            print(
                f"replicas={replicas} hit rate before {hit_before:.3f}, "
                f"after the kill {_hit_rate(at_once):.3f} ({len(at_once)} gets), after the "
                f"master noticed {hit_after:.3f}"
            )
            if replicas == 2:
                assert hit_after >= 0.9 * hit_before, after
                assert _hit_rate(at_once) >= 0.9 * hit_before, at_once
            else:
                assert hit_after < hit_before, after
                # before the master declares A dead (at_once) and after
                # before the master declares A dead (the kill is over when a read starts
                # after it: the last killed read may have started before) and after
                assert {r["cause"] for r in at_once[1:] + after} == {"holder_lost"}, (
                    at_once,
                    after,
                )
            assert b.poll() is None
        finally:
            open(os.path.join(d, "stop"), "w").close()
            for p in procs:
                kill_group(p, wait_s=5)
            for log in logs:
                log.close()
