r"""``mooncake-run``: start the ranks of a fault-tolerant ``mooncake`` job on one node.

Usage (``python -m mooncake_pg.run`` is the same)::

    mooncake-run --nproc-per-node 4 [--max-restarts 3] train.py --my-args ...
    mooncake-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \
        --nproc-per-node 4 train.py            # node 1: --node-rank 1, same address

What it does, and why plain ``torchrun`` cannot: torchrun restarts *every* local worker
when one dies (its rendezvous starts a new round for the whole group), so on one node a
dead rank takes the whole job down with it. ``mooncake-run`` instead

* hosts the control store (a ``TCPStore`` created without waiting for workers, so absent
  or dead seats never block anyone) on node 0 and keeps it alive for the whole run; ranks
  reach it through ``MASTER_ADDR``/``MASTER_PORT`` with ``TORCHELASTIC_USE_AGENT_STORE``
  set, so ``init_process_group(init_method="env://")`` (the default) connects to it and
  rank 0 does not host it (rank 0 may die like any other rank);
* starts each rank in its own process session (``torch.distributed.elastic``'s
  ``SubprocessHandler``) with torchrun's environment (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
  ``TORCHELASTIC_RESTART_COUNT``);
* when a rank dies (non-zero exit or signal), respawns only that rank, with
  ``MOONCAKE_IS_RECOVERY=1`` so its ``init_process_group`` joins the running group (the
  script then calls ``mooncake_pg.join_group`` and ``sync_state``; the survivors call
  ``recover_ranks``), at most ``--max-restarts`` times per rank;
* with ``--max-group-size`` larger than the ranks it starts, the other seats are extension
  seats (``MOONCAKE_ACTIVE_RANKS`` names the founders).

Exit status: 0 when every rank exited 0; otherwise 1 (a rank that failed more than
``--max-restarts`` times, or a launcher error), after the other ranks finished. SIGINT /
SIGTERM stop every rank (SIGTERM to its process group, SIGKILL after
``--shutdown-grace`` seconds; further signals are ignored meanwhile) and exit with
128 + the signal number. The control store listens on ``--master-addr``
(127.0.0.1 by default, so a one-node job is reachable from this host only).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import shlex
import signal
import socket
import sys
import time
from datetime import timedelta

_PR_SET_PDEATHSIG = 1


def _log(msg: str) -> None:
    sys.stderr.write(f"[mooncake-run] {msg}\n")
    sys.stderr.flush()


def parse_args(argv=None) -> argparse.Namespace:
    """Parses ``mooncake-run``'s command line (``argv``: ``sys.argv[1:]`` when None).

    Inconsistent options (``--node-rank`` outside ``[0, nnodes)``, ``--max-group-size`` below
    ``nnodes * nproc-per-node``, no ``--master-port`` with ``--nnodes > 1``, ...) exit through
    ``argparse``'s error, naming the option.
    """
    p = argparse.ArgumentParser(
        prog="mooncake-run",
        description="Start the ranks of a fault-tolerant mooncake job on this node; a dead rank "
        "is respawned alone (MOONCAKE_IS_RECOVERY=1) and rejoins the running group.",
    )
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        default=1,
        help="ranks started on this node (default 1)",
    )
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (static; default 1)")
    p.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        default=0,
        help="this node's index in [0, nnodes); node 0 hosts the control store",
    )
    p.add_argument(
        "--master-addr",
        "--master_addr",
        default="127.0.0.1",
        help="address of the control store, hosted by node 0's launcher (default 127.0.0.1)",
    )
    p.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=0,
        help="its port (default: a free port; required with --nnodes > 1)",
    )
    p.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=3,
        help="respawns allowed per rank (default 3)",
    )
    p.add_argument(
        "--max-group-size",
        type=int,
        default=None,
        help="seats of the group (world size); seats beyond nnodes*nproc-per-node are "
        "extension seats, filled later by processes started with is_recovery=True",
    )
    p.add_argument(
        "--monitor-interval",
        "--monitor_interval",
        type=float,
        default=0.1,
        help="seconds between checks of the ranks (default 0.1)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)",
    )
    p.add_argument(
        "--log-dir",
        "--log_dir",
        default=None,
        help="write each rank's stdout/stderr to DIR/rank<r>.<attempt>.{out,err} "
        "(default: inherit this terminal)",
    )
    p.add_argument(
        "--sidecar",
        action="append",
        default=[],
        metavar="CMD",
        help="a further process started with the ranks but outside the group (e.g. a "
        "rollout worker; shell-style words, run as is); it gets MASTER_ADDR/"
        "MASTER_PORT and SIDECAR_INDEX, is not respawned, and a non-zero exit "
        "fails the run; repeatable",
    )
    p.add_argument(
        "--store-timeout",
        type=float,
        default=300.0,
        help="seconds a rank's control-store call may wait (default 300)",
    )
    p.add_argument(
        "-m", "--module", action="store_true", help="run the script as a Python module (python -m)"
    )
    p.add_argument(
        "--no-python",
        "--no_python",
        action="store_true",
        help="run the script as an executable, not through Python",
    )
    p.add_argument("script", help="the training script (or module / executable)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args(argv)
    if a.nproc_per_node < 1 or a.nnodes < 1:
        p.error(
            f"--nproc-per-node and --nnodes must be >= 1, got {a.nproc_per_node} and {a.nnodes}"
        )
    if not 0 <= a.node_rank < a.nnodes:
        p.error(f"--node-rank must lie in [0, nnodes={a.nnodes}), got {a.node_rank}")
    if a.nnodes > 1 and a.master_port == 0:
        p.error("--master-port is required with --nnodes > 1 (every node must name the same store)")
    if not 0 <= a.master_port <= 65535:
        p.error(f"--master-port must lie in [0, 65535], got {a.master_port}")
    if not a.store_timeout > 0 or not a.monitor_interval > 0 or a.shutdown_grace < 0:
        p.error("--store-timeout and --monitor-interval must be > 0 and --shutdown-grace >= 0")
    if a.max_restarts < 0:
        p.error(f"--max-restarts must be >= 0, got {a.max_restarts}")
    founders = a.nnodes * a.nproc_per_node
    if a.max_group_size is not None and a.max_group_size < founders:
        p.error(
            f"--max-group-size ({a.max_group_size}) must be >= nnodes * nproc-per-node ({founders})"
        )
    if a.module and a.no_python:
        p.error("--module and --no-python exclude each other")
    return a


@dataclasses.dataclass(kw_only=True)
class RankProcess:
    """One seat's current process: its rank, attempt number (0 = first start) and handle."""

    rank: int
    local_rank: int
    attempt: int
    handler: object
    started: float


def _host_control_store(addr: str, port: int, timeout: float):
    """The control store on ``addr:port`` (port 0: a free one); returns (store, port).

    The listening socket is bound here, to ``addr`` only, and handed to the store, so the store is
    reachable on that address alone (not on every interface).
    """
    import torch.distributed as dist

    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(sockaddr)
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        addr,
        port,
        None,
        True,
        timedelta(seconds=timeout),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
        use_libuv=False,
    )
    return store, port


class Launcher:
    """The launcher of one node: starts, respawns and stops its ranks and sidecars.

    On node 0 it also hosts the control store.

    Args:
        args: the parsed command line (:func:`parse_args`).
    """

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.founders = args.nnodes * args.nproc_per_node
        self.world_size = args.max_group_size or self.founders
        self.procs: dict[int, RankProcess] = {}
        self.restarts: dict[int, int] = {}
        self.failed: dict[int, int] = {}  # rank -> exit code, out of restarts
        self.exited: dict[int, int] = {}  # rank -> 0
        self.store = None
        self.port = args.master_port
        self._stopping = False
        self.sidecars: dict[int, object] = {}  # index -> SubprocessHandler
        self.sidecar_failed: dict[int, int] = {}

    # -- environment of one rank
    def _env(self, rank: int, local_rank: int, attempt: int) -> dict:
        a = self.args
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(a.nproc_per_node),
            "GROUP_RANK": str(a.node_rank),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": a.master_addr,
            "MASTER_PORT": str(self.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(a.max_restarts),
            "TORCHELASTIC_RUN_ID": f"mooncake-{os.getpid()}",
            "MOONCAKE_IS_RECOVERY": "1" if attempt > 0 else "0",
            "PYTHONUNBUFFERED": "1",
        }
        if self.world_size > self.founders:
            env["MOONCAKE_ACTIVE_RANKS"] = ",".join(str(r) for r in range(self.founders))
        if a.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun: the ranks share this node's cores
        return env

    def _spawn(self, rank: int, local_rank: int, attempt: int) -> RankProcess:
        a = self.args
        if a.no_python:
            entry, argv = a.script, list(a.script_args)
        elif a.module:
            entry, argv = sys.executable, ["-u", "-m", a.script, *a.script_args]
        else:
            entry, argv = sys.executable, ["-u", a.script, *a.script_args]
        h = self._handler(
            entry, argv, self._env(rank, local_rank, attempt), f"rank{rank}.{attempt}", local_rank
        )
        return RankProcess(
            rank=rank, local_rank=local_rank, attempt=attempt, handler=h, started=time.monotonic()
        )

    def _handler(self, entry: str, argv: list, env: dict, log_name: str, local_rank: int):
        from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

        class _Handler(SubprocessHandler):
            # ranks die with the launcher, even if it is SIGKILLed
            def _popen(self, args, env):
                import subprocess

                libc = ctypes.CDLL(None, use_errno=True)
                return subprocess.Popen(
                    args=args,
                    env=env,
                    stdout=self._stdout,
                    stderr=self._stderr,
                    start_new_session=True,
                    preexec_fn=lambda: libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0),
                )

        a = self.args
        out = err = None
        if a.log_dir:
            os.makedirs(a.log_dir, exist_ok=True)
            out = os.path.join(a.log_dir, f"{log_name}.out")
            err = os.path.join(a.log_dir, f"{log_name}.err")
        return _Handler(entry, tuple(argv), env, out, err, local_rank, None)

    # -- life cycle
    def start(self) -> None:
        """Hosts the control store (node 0) and starts this node's ranks (attempt 0) and sidecars.

        Raises ``ValueError`` for an empty ``--sidecar`` command.
        """
        a = self.args
        if a.node_rank == 0:
            self.store, self.port = _host_control_store(
                a.master_addr, a.master_port, a.store_timeout
            )
            _log(
                f"control store on {a.master_addr}:{self.port}; world size {self.world_size} "
                f"({self.founders} founding seats), max {a.max_restarts} restarts per rank"
            )
        for local in range(a.nproc_per_node):
            rank = a.node_rank * a.nproc_per_node + local
            self.restarts[rank] = 0
            self.procs[rank] = self._spawn(rank, local, 0)
        for i, cmd in enumerate(a.sidecar):
            words = shlex.split(cmd)
            if not words:
                raise ValueError(f"mooncake-run: --sidecar {cmd!r} is empty")
            env = {
                "MASTER_ADDR": a.master_addr,
                "MASTER_PORT": str(self.port),
                "SIDECAR_INDEX": str(i),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "PYTHONUNBUFFERED": "1",
            }
            self.sidecars[i] = self._handler(words[0], words[1:], env, f"sidecar{i}", 0)

    def poll_once(self) -> None:
        """Reaps the ranks and sidecars that exited since the last call; respawns dead ranks alone.

        A rank that dies (non-zero exit or signal) is respawned with ``MOONCAKE_IS_RECOVERY=1``
        until it has used ``--max-restarts``; then it is recorded as failed. A sidecar is never
        respawned; its non-zero exit is recorded as a failure. While stopping, nothing is respawned
        or recorded as failed.
        """
        for i, h in list(self.sidecars.items()):
            rc = h.proc.poll()
            if rc is None:
                continue
            del self.sidecars[i]
            if rc != 0 and not self._stopping:
                self.sidecar_failed[i] = rc
            _log(f"sidecar {i} exited {rc}")
        for rank, p in list(self.procs.items()):
            rc = p.handler.proc.poll()
            if rc is None:
                continue
            del self.procs[rank]
            try:
                p.handler.close(signal.SIGKILL)  # the rank's leftover children, if any
            except ProcessLookupError:
                pass
            if rc == 0:
                self.exited[rank] = 0
                _log(f"rank {rank} exited 0")
                continue
            how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
            if self._stopping:
                continue
            if self.restarts[rank] >= self.args.max_restarts:
                self.failed[rank] = rc
                _log(
                    f"rank {rank} died ({how}) after {self.restarts[rank]} restarts; not respawned "
                    f"(--max-restarts {self.args.max_restarts})"
                )
                continue
            self.restarts[rank] += 1
            _log(
                f"rank {rank} died ({how}); respawning it alone (restart {self.restarts[rank]}/"
                f"{self.args.max_restarts}, MOONCAKE_IS_RECOVERY=1)"
            )
            self.procs[rank] = self._spawn(rank, p.local_rank, self.restarts[rank])

    def run(self, tick=None) -> int:
        """Starts everything and supervises until every rank and sidecar has exited.

        Args:
            tick: if given, ``tick(launcher)`` is called every ``--monitor-interval`` seconds (the
                control store is ``launcher.store`` on node 0).

        Returns:
            1 when a rank failed more than ``--max-restarts`` times or a sidecar exited non-zero,
            else 0.
        """
        self.start()
        while self.procs or self.sidecars:
            time.sleep(self.args.monitor_interval)
            self.poll_once()
            if tick is not None:
                tick(self)
        if self.failed or self.sidecar_failed:
            what = [f"ranks {sorted(self.failed)}"] if self.failed else []
            what += [f"sidecars {sorted(self.sidecar_failed)}"] if self.sidecar_failed else []
            _log(f"finished: {' and '.join(what)} failed for good; exit 1")
            return 1
        _log(
            f"finished: all {len(self.exited)} ranks exited 0 "
            f"({sum(self.restarts.values())} restarts)"
        )
        return 0

    def stop(self, why: str) -> None:
        """Stops every rank and sidecar and waits for them.

        Each gets SIGTERM to its process group, then SIGKILL after ``--shutdown-grace`` seconds.

        Args:
            why: the reason, logged with the ranks being stopped.
        """
        self._stopping = True
        if self.procs:
            _log(f"{why}: stopping ranks {sorted(self.procs)}")
        handlers = [p.handler for p in self.procs.values()] + list(self.sidecars.values())
        for h in handlers:
            try:
                os.killpg(h.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + self.args.shutdown_grace
        while time.monotonic() < deadline and any(h.proc.poll() is None for h in handlers):
            time.sleep(0.05)
        for h in handlers:
            try:
                os.killpg(h.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            h.proc.wait()
        self.procs.clear()
        self.sidecars.clear()


def main(argv: list | None = None, tick=None) -> int:
    """``mooncake-run``'s entry point; ``tick`` as in :meth:`Launcher.run`."""
    args = parse_args(argv)
    launcher = Launcher(args)

    got = {}

    def on_signal(signum, _frame):
        got["sig"] = signum
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return launcher.run(tick)
    except KeyboardInterrupt:
        signum = got.get("sig", signal.SIGINT)
        for sig in (
            signal.SIGTERM,
            signal.SIGINT,
        ):  # a second signal does not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        launcher.stop(f"interrupted ({signal.Signals(signum).name})")
        return 128 + int(signum)
    except BaseException:
        launcher.stop("launcher error")
        raise


def demo_main(argv: list | None = None) -> int:
    """``mooncake-demo``: runs ``examples/moe_rl_demo.py`` of this checkout with ``argv``.

    ``examples/moe_rl_demo.py`` is the main job; see its docstring.
    """
    import runpy

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "moe_rl_demo.py"
    )
    if not os.path.exists(path):
        _log(
            f"mooncake-demo: {path} not found (the demo runs from a source checkout, installed with "
            "pip install --no-build-isolation -e .)"
        )
        return 2
    sys.argv = [path, *(sys.argv[1:] if argv is None else argv)]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
