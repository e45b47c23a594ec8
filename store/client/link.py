"""The client's link to the master: the metadata connection (framing in ``protocol``),
leader following and failover (etcd), registration, heartbeats, and the thread that runs
the tasks the master hands out (SSD offloads and loads, deletes, reservation returns).

Mixed into :class:`~mooncake_store.MooncakeStore`, whose ``__init__`` sets the state these
methods use (``cfg``, ``client_id``, ``_lock``, ``_conn``, ``_session``, ...).
"""

from __future__ import annotations

import logging
import os
import queue
import time

from ..common import protocol
from ..common.config import parse_hostport
from ..common.errors import (
    NotLeaderError,
    ProtocolError,
    StoreError,
    TransferError,
    UnknownClientError,
)
from . import ssd

log = logging.getLogger("mooncake_store")

# after a call gave up on the master, calls for this long try once (for _QUICK_S) instead
# of waiting out the failover again
_GAVE_UP_S = 2.0
_QUICK_S = 1.0  # such a call's one try
_RESV_IDLE_S = 3.0  # a put reservation unused this long goes back to the master


class _LinkMixin:
    """Metadata requests to the master, heartbeats and the master's tasks."""

    def _register(self):
        segs = [self._segment.desc(self.cfg.host_id, self._te_desc())] if self._segment else []
        res = self._call(
            "register",
            {
                "client": self.client_id,
                "name": self.name,
                "host": self.cfg.host_id,
                "pid": os.getpid(),
                "segs": segs,
                "ssd_dir": self.cfg.ssd_dir,
                "ssd_max": self.cfg.ssd_max_bytes,
                "ssd": [],
            },
            register=False,
        )
        self._lease_ttl = res["ttl_ms"] / 1000.0
        self._client_ttl = res.get("client_ttl_ms", 5000) / 1000.0
        if self.cfg.ssd_dir:  # files found on disk, in chunks well below the frame limit
            chunk, size = [], 0
            for e in ssd.scan(self.cfg.ssd_dir) + [None]:
                if e is not None:
                    chunk.append(e)
                    size += len(e[0]) + len(e[3]) + len(e[4]) + 32
                if chunk and (e is None or size > (512 << 10)):
                    self._call(
                        "adopt_ssd", {"client": self.client_id, "entries": chunk}, register=False
                    )
                    chunk, size = [], 0

    def _resolve(self) -> str | None:
        if self.cfg.etcd is None:
            return self.cfg.master
        from ..common.etcd import Etcd, describe

        if self._etcd is None:
            self._etcd = Etcd(self.cfg.etcd, self.cfg.etcd_prefix)
        try:
            rec = self._etcd.leader()
        except Exception as e:  # etcd unreachable: said in the error the caller sees
            self._etcd_error = f"etcd {self.cfg.etcd} unreachable: {describe(e)}"
            return None
        self._etcd_error = None
        return rec["addr"] if rec else None

    def _connect(self, timeout: float | None = None) -> protocol.Connection:
        addr = self._resolve()
        if addr is None:
            raise ConnectionError(
                f"no store master leads ({self._etcd_error or 'etcd has no leader record'})"
            )
        host, port = parse_hostport(addr, "master")
        return protocol.Connection(
            host,
            port,
            secret=self.cfg.secret,
            timeout=self.cfg.rpc_timeout_s if timeout is None else timeout,
            busy_poll_us=self.cfg.rpc_busy_poll_us,
        )

    def _call(
        self,
        method: str,
        args: dict,
        register=True,
        sent_at: list | None = None,
        fail_fast: bool = True,
    ):
        """One metadata request; follows leader changes for ``failover_timeout_s`` from the
        first failure (a request that waited out ``rpc_timeout_s`` on a stopped leader then
        still goes to its successor), each retry bounded by what is left of that: at most
        ``rpc_timeout_s + failover_timeout_s`` in all. ``sent_at``: a list that gets the
        ``time.monotonic()`` at which the request that answered was sent (a lease runs from
        then). ``fail_fast``: within ``_GAVE_UP_S`` of a call that gave up, one try of
        ``_QUICK_S`` (False: a clean-up the client owes the master, tried in full)."""
        start = time.monotonic()
        deadline = None
        reregistered = False
        if self._exiting:  # interpreter exit: one short try, never a wait for a failover
            if not self._lock.acquire(timeout=1.0):
                raise StoreError(f"{method}: the store client is busy at exit")
            try:
                if self._conn is None:
                    raise StoreError(f"{method}: no connection at exit")
                return self._conn.call(method, args, timeout=1.0)
            except (OSError, ProtocolError) as e:
                raise StoreError(f"{method} at exit: {e}") from None
            finally:
                self._lock.release()
        gave_up = self._gave_up
        # a call right after one that waited out the failover tries once, briefly: a pull's
        # clean-up after a cut link would wait again for each of its calls
        quick = fail_fast and gave_up is not None and start - gave_up[0] < _GAVE_UP_S
        bound = start + (
            min(_QUICK_S, self.cfg.rpc_timeout_s)
            if quick
            else self.cfg.rpc_timeout_s + self.cfg.failover_timeout_s
        )
        conn = None
        while True:
            try:
                # another thread's call may hold the connection: waiting for it counts too
                if not self._lock.acquire(timeout=max(0.0, bound - time.monotonic())):
                    why = (
                        f"no store master answered {method} within {time.monotonic() - start:.1f} s"
                    )
                    self._gave_up = (time.monotonic(), why)
                    raise StoreError(
                        why + " (another call of this client held the connection meanwhile, "
                        "waiting for the master)"
                    )
                try:
                    if self._closed and method != "unregister":
                        raise StoreError("the store client is closed")
                    end = bound if deadline is None else deadline
                    left = max(0.1, min(self.cfg.rpc_timeout_s, end - time.monotonic()))
                    if self._conn is None:
                        self._conn = self._connect(left)
                        self._conn.timeout = self.cfg.rpc_timeout_s  # later calls' own bound
                        self._session += 1
                    conn = self._conn
                    t = time.monotonic()
                    res = conn.call(method, args, timeout=left)
                    if sent_at is not None:
                        sent_at.append(t)
                    return res
                finally:
                    self._lock.release()
            except UnknownClientError:
                if not register or reregistered:
                    raise
                reregistered = True
                self._session += 1  # the master forgot this client, and its reservation
                self._register()
            except (OSError, NotLeaderError) as e:
                # drop the connection this call used; a call holding the lock past the bound
                # is using it (or a newer one) and drops it itself if it fails
                if self._lock.acquire(timeout=max(0.0, bound - time.monotonic())):
                    try:
                        if conn is not None and self._conn is conn:
                            self._conn.close()
                            self._conn = None
                    finally:
                        self._lock.release()
                if quick:
                    self._gave_up = (time.monotonic(), gave_up[1])
                    raise StoreError(
                        f"no store master answered {method} within {time.monotonic() - start:.1f} s"
                        f" (one try: {start - gave_up[0]:.1f} s before, {gave_up[1]}): {e}"
                    ) from None
                if deadline is None:  # a late first failure (the lock waited) keeps the bound
                    deadline = min(bound, time.monotonic() + self.cfg.failover_timeout_s)
                elif time.monotonic() >= deadline:
                    why = (
                        f"no store master answered {method} within {time.monotonic() - start:.1f} s"
                    )
                    self._gave_up = (time.monotonic(), why)
                    raise StoreError(
                        f"{why} (rpc_timeout_s={self.cfg.rpc_timeout_s:g}, then failover_timeout_s="
                        f"{self.cfg.failover_timeout_s:g} of retries): {e}"
                    ) from None
                time.sleep(0.1)

    def _poll_main(self):
        conn = None
        connected = False
        while not self._closed:
            try:
                if conn is None:
                    conn = self._connect_poll()
                    if connected:
                        self._session += (
                            1  # perhaps another master now: put reservations are asked for again
                        )
                    connected = True
                res = conn.call(
                    "poll",
                    {
                        "client": self.client_id,
                        "wait_ms": int(self.cfg.heartbeat_interval_s * 1000),
                        "epoch": self._epoch,
                    },
                    timeout=self.cfg.heartbeat_interval_s + self._poll_slack(),
                )
                if "segs" in res:
                    self._epoch = res["epoch"]
                    self._maps.retain(set(res["segs"]))
                    self._ro_maps.retain(set(res["segs"]))
                for task in res["tasks"]:
                    self._tasks.put(
                        task
                    )  # run by the task thread: heartbeats never wait for a disk or an RPC
            except UnknownClientError:
                if self._closed:
                    break
                try:
                    self._register()
                except Exception as e:
                    log.warning("store: re-registering failed: %s", e)
                    time.sleep(0.2)
            except Exception:
                if conn is not None:
                    conn.close()
                    conn = None
                if not self._closed:
                    time.sleep(0.1)
        if conn is not None:
            conn.close()

    def _task_main(self):
        """Runs the master's tasks (SSD offloads and loads, deletes, reservation returns)
        in order, and gives an idle put reservation back. Apart from the heartbeat thread:
        a long SSD write or an RPC stuck on a stopped master must not delay heartbeats past
        the master's client TTL."""
        while not self._closed:
            try:
                task = self._tasks.get(timeout=0.25)
            except queue.Empty:
                task = None
            if task is None and self._closed:
                break
            try:
                if task is not None:
                    self._run_task(task)
                r = self._resv
                if (
                    r is not None and time.monotonic() - r.used_at > _RESV_IDLE_S
                ) or self._resv_orphans:
                    self._give_back_reservation(wait=False)
            except Exception as e:
                if not self._closed:
                    log.warning(
                        "store: task %r failed: %s", task[0] if task else "reservation give-back", e
                    )

    def _poll_slack(self) -> float:
        """Seconds a heartbeat may go unanswered (and a connect take) before the poll
        thread gives up on that master and finds the leader again: a third of the master's
        client TTL, so a stopped (SIGSTOP) or hung leader still lets heartbeats reach its
        successor within the TTL it grants every client (found by a new-user trial: stuck
        for rpc_timeout_s + 3 s, the client was declared dead and all its objects dropped)."""
        return min(self.cfg.rpc_timeout_s, max(1.0, self._client_ttl / 3))

    def _connect_poll(self):
        if self.cfg.etcd is None:
            host, port = parse_hostport(self.cfg.master, "master")
        else:
            from ..common.etcd import Etcd

            if not hasattr(self, "_poll_etcd"):
                self._poll_etcd = Etcd(self.cfg.etcd, self.cfg.etcd_prefix)
            rec = self._poll_etcd.leader()
            if rec is None:
                raise ConnectionError("no leader")
            host, port = parse_hostport(rec["addr"], "master")
        return protocol.Connection(host, port, secret=self.cfg.secret, timeout=self._poll_slack())

    def _run_task(self, task):
        op = task[0]
        if op == "unreserve":
            self._give_back_reservation(wait=True)
        elif op == "delete" and self.cfg.ssd_dir:
            path = task[1]
            if os.path.realpath(path).startswith(os.path.realpath(self.cfg.ssd_dir) + os.sep):
                ssd.delete(path)
        elif op == "load" and self._segment is not None:
            _, key, version, path, off, size = task
            ok, corrupt = False, False
            try:
                ssd.read_into(path, key, version, self._segment.view[off : off + size])
                ok = True
            except TransferError as e:
                corrupt = isinstance(e, ssd.CorruptError)
                log.warning("store: loading %r from SSD failed: %s", key, e)
            try:
                self._call(
                    "load_done",
                    {"client": self.client_id, "key": key, "version": version, "ok": ok},
                )
            except StoreError as e:
                log.warning("store: load_done: %s", e)
            if corrupt:
                self._report_corrupt(key, version, path)
        elif op == "offload" and self._segment is not None and self.cfg.ssd_dir:
            _, key, version, off, size, meta = task
            ok, path = False, ""
            try:
                path = ssd.write(
                    self.cfg.ssd_dir, key, version, meta, self._segment.view[off : off + size]
                )
                ok = True
            except OSError as e:
                log.warning("store: offload of %r failed: %s", key, e)
            try:
                self._call(
                    "offload_done",
                    {
                        "client": self.client_id,
                        "key": key,
                        "version": version,
                        "path": path,
                        "ok": ok,
                    },
                )
            except StoreError as e:
                log.warning("store: offload_done: %s", e)

    def _report_corrupt(self, key: str, version: int, path: str):
        """Tells the master an SSD file of ``key`` is missing or corrupt: it drops that
        replica (and the object when none is left), so later gets miss instead of failing."""
        try:
            self._call(
                "ssd_bad", {"client": self.client_id, "key": key, "version": version, "path": path}
            )
        except StoreError as e:
            log.warning("store: reporting the corrupt SSD file %s: %s", path, e)
