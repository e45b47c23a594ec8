"""Ranks on several emulated hosts: one process per rank inside the network namespace of its
host (tests/netns.py), each host with a hostname of its own, rendezvous through
``init_method="tcp://<host 0's address>:PORT"`` (rank 0 hosts the TCPStore), no interface
hints unless a test passes them.

    with netns.hosts(2) as t:
        res = run_ranks(t, [2, 2], "every_op", {"dtype": "float32"}, timeout_s=120)
        # res[rank] -> the dict the rank's scenario returned, or {"error": ..., ...}

A scenario is a function ``name(rank, world_size, **args) -> dict`` in
:mod:`tests.multihost_rank`, run after ``init_process_group``; its result travels back as JSON
in a file per rank (a benchmark's rank program prints one ``RESULT <json>`` line instead).
Every rank process is a session leader and is
SIGKILLed as a group when it outlives ``timeout_s``; the namespaces' own clean-up kills
anything left.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from tests import REPO_ROOT, netns
from tests.faults import kill_group

PORT = 29400  # any port: the namespaces and their addresses belong to this run alone


def store_master_address() -> tuple:
    """(host, port) for a store master in rank 0 of a multi-host run: host 0's address
    (the rendezvous' host, from MH_INIT) and the rendezvous port + 7."""
    host, _, port = os.environ["MH_INIT"].removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port) + 7


def rank_hosts(ranks_per_host: list) -> list:
    """Host index of each rank: ranks fill host 0 first, then host 1, ..."""
    return [h for h, g in enumerate(ranks_per_host) for _ in range(g)]


class Ranks:
    """Rank processes started by :func:`start_ranks`; :meth:`results` collects them."""

    def __init__(self, procs: list, result_files: list | None = None):
        self.procs = procs
        self.result_files = result_files or [None] * len(procs)

    def results(self, timeout_s: float, ranks=None) -> dict:
        """{rank: result dict} for ``ranks`` (default: all), waiting at most ``timeout_s``
        in all; then every rank process still running is SIGKILLed as a group."""
        deadline = time.monotonic() + timeout_s
        out = {}
        try:
            for rank, p in enumerate(self.procs):
                if ranks is not None and rank not in ranks:
                    continue
                try:
                    stdout, stderr = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    kill_group(p)
                    stdout, stderr = p.communicate()
                    out[rank] = {"error": "timeout", "log": (stdout + stderr)[-3000:]}
                    continue
                # stderr apart: a library's log line cannot land inside a long RESULT line
                res = [ln[7:] for ln in stdout.splitlines() if ln.startswith("RESULT ")]
                path = self.result_files[rank]
                if path and os.path.exists(path):
                    with open(path) as f:
                        res = [f.read()]
                    os.unlink(path)
                log = "\n".join(ln for ln in stdout.splitlines() if not ln.startswith("RESULT "))
                log += "\n" + stderr
                out[rank] = (
                    {**json.loads(res[-1]), "log": log[-3000:]}
                    if res
                    else {"error": "no result", "rc": p.returncode, "log": log[-3000:]}
                )
                # C++ stack traces in the whole output (torch prints one per failed store call)
                out[rank]["stack_traces"] = log.count("Exception raised from")
        finally:
            for p in self.procs:
                kill_group(p)
            # every rank process is gone now: their results' folder goes too
            for d in {os.path.dirname(f) for f in self.result_files if f}:
                shutil.rmtree(d, ignore_errors=True)
        return out


def run_ranks(*args, timeout_s: float = 120.0, **kwargs) -> dict:
    """:func:`start_ranks` and wait for every rank's result."""
    return start_ranks(*args, **kwargs).results(timeout_s)


def run_bench(
    ranks_per_host: list,
    argv: list,
    plan: dict,
    *,
    prefix: str,
    rate_bit: int | None,
    timeout_s: float,
    delay_us: int = 0,
) -> dict:
    """A benchmark's rank program (argv, reading MH_ARGS = plan) on fresh hosts whose links
    are limited to rate_bit (and delayed by delay_us); gloo is pointed at eth0 (the
    namespaces' hostnames do not resolve). Returns {rank: result} as :func:`run_ranks`."""
    with netns.hosts(len(ranks_per_host), prefix, rate_bit=rate_bit, delay_us=delay_us) as t:
        return run_ranks(
            t,
            ranks_per_host,
            "bench",
            plan,
            env={"GLOO_SOCKET_IFNAME": "eth0"},
            timeout_s=timeout_s,
            argv=argv,
        )


def start_ranks(
    t: netns.Topo,
    ranks_per_host: list,
    scenario: str,
    args: dict | None = None,
    *,
    env: dict | None = None,
    rank_env: dict | None = None,
    backend: str = "mooncake",
    argv: list | None = None,
) -> Ranks:
    """Starts ``scenario`` on ``sum(ranks_per_host)`` ranks (each rank's stdout is piped).

    env: extra variables for every rank; rank_env: {rank: {var: value}} for single ranks.
    argv: the rank program (default ``python -m tests.multihost_rank``); it gets MH_RANK,
    MH_WORLD_SIZE, MH_HOST, MH_LOCAL_RANK, MH_RANKS_PER_HOST, MH_INIT, MH_BACKEND,
    MH_SCENARIO, MH_ARGS (JSON) and MH_RESULT_FILE in its environment and writes its JSON
    result to that file (or prints one ``RESULT <json>`` line, as the benchmarks' do).
    Each result carries the tail of the rank's output under "log"; a rank that exits without
    a result gets {"error": "no result", "rc": ..., "log": ...}.
    """
    hosts = rank_hosts(ranks_per_host)
    world_size = len(hosts)
    init = f"tcp://{t.addr[t.hosts[0]]}:{PORT}"
    procs = []
    # results of tests.multihost_rank go through a file: a long RESULT line on a pipe could
    # be split by another writer when the pipe is full (seen at 64 KiB)
    result_dir = tempfile.mkdtemp(prefix="mh-results-")
    files = [os.path.join(result_dir, f"rank{r}.json") for r in range(world_size)]
    for rank, h in enumerate(hosts):
        e = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("MOONCAKE_", "MASTER_", "GLOO_"))
            and k not in ("RANK", "WORLD_SIZE")
        }
        e.update(
            {
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])
                ),
                "OMP_NUM_THREADS": "1",
                "MH_SCENARIO": scenario,
                "MH_ARGS": json.dumps(args or {}),
                "MH_INIT": init,
                "MH_BACKEND": backend,
                "MH_RANK": str(rank),
                "MH_WORLD_SIZE": str(world_size),
                "MH_HOST": str(h),
                "MH_LOCAL_RANK": str(rank - hosts.index(h)),
                "MH_RANKS_PER_HOST": ",".join(str(g) for g in ranks_per_host),
                "MH_RESULT_FILE": files[rank],
            }
        )
        e.update(env or {})
        e.update((rank_env or {}).get(rank, {}))
        procs.append(
            netns.run_in(
                t.hosts[h],
                argv or [sys.executable, "-m", "tests.multihost_rank"],
                env=e,
                hostname=f"host{h}",
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return Ranks(procs, files)
