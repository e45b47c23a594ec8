"""Killing test processes: one API for every fault test.

Rank side (inside a rank of a :mod:`tests.rankpool` pool):

* :func:`kill_self` SIGKILLs the calling rank (after one ``[fault]`` line in its log);
* :class:`Fault` is a declarative fault, "rank ``victim`` dies at collective ``op``"
  (round ``round`` of that op with ``how="inject"``), armed with :func:`make_group` and
  fired by :func:`maybe_die`; :func:`victim_survived` reports a fault that did not fire.

Test-process side:

* :func:`kill_group` signals a process group (every helper process and rank runs in a
  session of its own, so its pid is its process group id);
* :func:`alive` and :func:`wait_dead` watch a pid until it is gone.

A zombie nobody reaped counts as dead everywhere here: the kernel has closed its sockets.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from typing import NoReturn

# ------------------------------------------------------------------ test-process side


def alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie nobody reaped counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def wait_dead(pid: int, timeout_s: float = 15.0) -> bool:
    """Polls until ``pid`` is gone (or a zombie); False if it still runs after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def kill_group(
    target: int | subprocess.Popen | None,
    sig: int = signal.SIGKILL,
    wait_s: float | None = None,
) -> None:
    """Sends ``sig`` to the process group led by ``target`` (a pid or a ``Popen`` started
    with ``start_new_session=True``), else to the process alone; a process that is already
    gone is no error. With a ``Popen`` and ``wait_s``, reaps it (waits at most ``wait_s``)."""
    if target is None:
        return
    pid = target.pid if isinstance(target, subprocess.Popen) else int(target)
    if not pid:
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    if wait_s is not None and isinstance(target, subprocess.Popen):
        try:
            target.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass


# ------------------------------------------------------------------------- rank side


def kill_self(rank: int, why: str = "") -> NoReturn:
    """SIGKILLs the calling process after writing ``[fault] rank R: SIGKILL why`` to its
    log (stderr), so the rank logs show where each victim died."""
    sys.stdout.flush()
    sys.stderr.write(f"[fault] rank {rank}: SIGKILL {why}".rstrip() + "\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never reached: SIGKILL is delivered before the call returns
    os._exit(1)


@dataclasses.dataclass(frozen=True)
class Fault:
    """Kill rank ``victim`` at collective ``op`` (0-based, counted on the test group).

    ``how``: ``"inject"`` (``MOONCAKE_FAULT_INJECT="op:round"``: the backend SIGKILLs the
    victim inside the op, before round ``round``), ``"sigkill"`` or ``"exit0"`` (the victim
    SIGKILLs itself / calls ``os._exit(0)`` between collectives ``op - 1`` and ``op``,
    see :func:`maybe_die`).
    """

    victim: int
    op: int
    how: str = "inject"  # "inject" | "sigkill" | "exit0"
    round: int = 0  # inject only: the round of op ``op`` the victim never reaches

    def __post_init__(self):
        assert self.how in ("inject", "sigkill", "exit0"), self.how

    def describe(self):
        if self.how == "inject":
            return f"rank {self.victim} SIGKILLed by MOONCAKE_FAULT_INJECT={self.op}:{self.round}"
        return f"rank {self.victim} {self.how} before collective {self.op}"


def make_group(rank, world_size, fault):
    """Rank side: the test group over every rank, with ``fault`` armed on the victim."""
    import torch.distributed as dist

    import mooncake_pg  # noqa: F401

    armed = fault is not None and fault.how == "inject" and rank == fault.victim
    if armed:
        os.environ["MOONCAKE_FAULT_INJECT"] = f"{fault.op}:{fault.round}"
    try:
        g = dist.new_group(list(range(world_size)))
    finally:
        os.environ.pop("MOONCAKE_FAULT_INJECT", None)
    return g


def maybe_die(rank, fault, op_index):
    """Rank side: call before issuing collective ``op_index`` of the test group; the victim
    of a between-collectives fault dies here."""
    if fault is None or rank != fault.victim or fault.how == "inject" or op_index != fault.op:
        return
    if fault.how == "sigkill":
        kill_self(rank, f"before collective {op_index}")
    sys.stdout.flush()
    sys.stderr.write(f"[fault] rank {rank}: exit0 before collective {op_index}\n")
    sys.stderr.flush()
    os._exit(0)


def victim_survived(rank, fault):
    """Rank side: the victim got past the point where it should have died."""
    raise AssertionError(
        f"rank {rank}: still alive after the fault ({fault.describe()}); the fault did not fire"
    )
