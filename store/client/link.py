"""The client's link to the master: the metadata connection, failover, registration, heartbeats.

The metadata connection has its framing in ``common/protocol.py``; leader following and failover go
through etcd; the heartbeat thread hands the tasks the master sends to ``tasks.py``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from ..common import protocol
from ..common.config import parse_hostport
from ..common.errors import (
    NotLeaderError,
    ProtocolError,
    StoreError,
    UnknownClientError,
)
from . import ssd
from .config import StoreConfig
from .dataplane import DataPlane

log = logging.getLogger("mooncake_store")

# after a call gave up on the master, calls for this long try once (for _QUICK_S) instead
# of waiting out the failover again
_GAVE_UP_S = 2.0
_QUICK_S = 1.0  # such a call's one try


class Link:
    """Metadata requests to the master, its heartbeats, and this client's registration.

    One connection; calls of several threads are serialised on it.

    Attributes:
        client_id: this client's id at the master.
        session: counts connections to a master (a put reservation is valid only in the
            session that got it).
        lease_ttl_s: the master's read lease (``MasterConfig.lease_ttl_s``), from
            registration.
        closed: no more requests but ``unregister`` (set by :meth:`close` and
            :meth:`unregister`).
        exiting: the interpreter exits: each request is one short try, never a wait for a
            failover.
        etcd_error: why etcd could not be asked who leads, when it could not.
    """

    def __init__(self, cfg: StoreConfig, client_id: str, dataplane: DataPlane):
        self.cfg = cfg
        self.client_id = client_id
        self._dataplane = dataplane
        self.session = 0
        self.lease_ttl_s = 5.0
        # the master's client_ttl_s (from register): heartbeats must reach it within
        self._client_ttl = 5.0
        self.closed = False
        self.exiting = False
        self.etcd_error: str | None = None
        self._lock = threading.RLock()  # the connection; another call's wait counts too
        self._conn: protocol.Connection | None = None
        self._gave_up: tuple | None = None  # (when, why) of the last call that gave up
        self._etcd = None
        self._poll_etcd = None  # the heartbeat thread's own etcd client
        self._epoch = -1  # the master's segment epoch last seen by the heartbeat
        self._poll_thread: threading.Thread | None = None
        # when a list: each request that answered appends (sent, answered, method), in
        # time.monotonic() seconds (a pull's timeline, weight_sync/timeline.py)
        self.trace: list | None = None

    def register(self) -> None:
        """Registers this client with the master, and takes the master's lease and client TTLs.

        What it registers: its segment, its SSD directory and the files found in it.
        """
        desc = self._dataplane.segment_desc()
        res = self.call(
            "register",
            {
                "client": self.client_id,
                "name": self.cfg.name,
                "host": self.cfg.host_id,
                "pid": os.getpid(),
                "segs": [] if desc is None else [desc],
                "ssd_dir": self.cfg.ssd_dir,
                "ssd_max": self.cfg.ssd_max_bytes,
                "ssd": [],
            },
            register=False,
        )
        self.lease_ttl_s = res["ttl_ms"] / 1000.0
        self._client_ttl = res.get("client_ttl_ms", 5000) / 1000.0
        if self.cfg.ssd_dir:  # files found on disk, in chunks well below the frame limit
            chunk, size = [], 0
            for e in ssd.scan(self.cfg.ssd_dir) + [None]:
                if e is not None:
                    chunk.append(e)
                    size += len(e[0]) + len(e[3]) + len(e[4]) + 32
                    if len(e) > 5:  # its links (parent, up to 16 tags, group)
                        size += len(str(e[5]))
                if chunk and (e is None or size > (512 << 10)):
                    self.call(
                        "adopt_ssd", {"client": self.client_id, "entries": chunk}, register=False
                    )
                    chunk, size = [], 0

    def resolve(self) -> str | None:
        """``HOST:PORT`` of the master to use: the configured one, or the leader etcd names.

        None when etcd names none or cannot be asked: ``etcd_error`` says why.
        """
        if self.cfg.etcd is None:
            return self.cfg.master
        from ..common.etcd import Etcd, describe

        if self._etcd is None:
            self._etcd = Etcd(self.cfg.etcd, self.cfg.etcd_prefix)
        try:
            rec = self._etcd.leader()
        except Exception as e:  # etcd unreachable: said in the error the caller sees
            self.etcd_error = f"etcd {self.cfg.etcd} unreachable: {describe(e)}"
            return None
        self.etcd_error = None
        return rec["addr"] if rec else None

    def _connect(self, timeout: float | None = None) -> protocol.Connection:
        addr = self.resolve()
        if addr is None:
            raise ConnectionError(
                f"no store master leads ({self.etcd_error or 'etcd has no leader record'})"
            )
        host, port = parse_hostport(addr, "master")
        return protocol.Connection(
            host,
            port,
            secret=self.cfg.secret,
            timeout=self.cfg.rpc_timeout_s if timeout is None else timeout,
            busy_poll_us=self.cfg.rpc_busy_poll_us,
        )

    def call(
        self,
        method: str,
        args: dict,
        register: bool = True,
        sent_at: list | None = None,
        fail_fast: bool = True,
    ):
        """One metadata request; follows leader changes for ``failover_timeout_s``.

        That time runs from the first failure: a request that waited out ``rpc_timeout_s`` on a
        stopped leader then still goes to its successor; each retry is bounded by what is left of
        that: at most ``rpc_timeout_s + failover_timeout_s`` in all.

        Args:
            method: the request's method (``common/protocol.py``).
            args: the request's arguments.
            register: a master that forgot this client gets it registered again, once.
            sent_at: a list that gets the ``time.monotonic()`` at which the request that answered
                was sent (a lease runs from then).
            fail_fast: within ``_GAVE_UP_S`` of a call that gave up, one try of ``_QUICK_S`` (False:
                a clean-up the client owes the master, tried in full).

        Returns:
            The master's result.

        Raises:
            StoreError: no master answered in time, the link is closed, or the master's own error
                (its class).
        """
        start = time.monotonic()
        deadline = None
        reregistered = False
        if self.exiting:  # interpreter exit: one short try, never a wait for a failover
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
                    if self.closed and method != "unregister":
                        raise StoreError("the store client is closed")
                    end = bound if deadline is None else deadline
                    left = max(0.1, min(self.cfg.rpc_timeout_s, end - time.monotonic()))
                    if self._conn is None:
                        self._conn = self._connect(left)
                        self._conn.timeout = self.cfg.rpc_timeout_s  # later calls' own bound
                        self.session += 1
                    conn = self._conn
                    t = time.monotonic()
                    res = conn.call(method, args, timeout=left)
                    if sent_at is not None:
                        sent_at.append(t)
                    trace = self.trace
                    if trace is not None:
                        trace.append((t, time.monotonic(), method))
                    return res
                finally:
                    self._lock.release()
            except UnknownClientError:
                if not register or reregistered:
                    raise
                reregistered = True
                self.session += 1  # the master forgot this client, and its reservation
                self.register()
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

    def start(self, on_task: Callable[[list], None]) -> None:
        """Starts the heartbeat thread; it passes each task the master hands out to ``on_task``.

        ``on_task`` must not block: heartbeats never wait for a disk or an RPC.
        """
        self._poll_thread = threading.Thread(
            target=self._poll_main, args=(on_task,), name="mooncake-store-heartbeat", daemon=True
        )
        self._poll_thread.start()

    def _poll_main(self, on_task):
        conn = None
        connected = False
        while not self.closed:
            try:
                if conn is None:
                    conn = self._connect_poll()
                    if connected:
                        # perhaps another master now: put reservations are asked for again
                        self.session += 1
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
                    self._dataplane.retain(set(res["segs"]))
                for task in res["tasks"]:
                    on_task(task)
            except UnknownClientError:
                if self.closed:
                    break
                try:
                    self.register()
                except Exception as e:
                    log.warning("store: re-registering failed: %s", e)
                    time.sleep(0.2)
            except Exception:
                if conn is not None:
                    conn.close()
                    conn = None
                if not self.closed:
                    time.sleep(0.1)
        if conn is not None:
            conn.close()

    def _poll_slack(self) -> float:
        """Seconds a heartbeat may go unanswered (and a connect take) before the master is given up.

        After that the poll thread gives up on that master and finds the leader again: a third of
        the master's client TTL, so a stopped (SIGSTOP) or hung leader still lets heartbeats reach
        its successor within the TTL it grants every client (waiting rpc_timeout_s + 3 s instead,
        the client would be declared dead and all its objects dropped).
        """
        return min(self.cfg.rpc_timeout_s, max(1.0, self._client_ttl / 3))

    def _connect_poll(self):
        if self.cfg.etcd is None:
            host, port = parse_hostport(self.cfg.master, "master")
        else:
            from ..common.etcd import Etcd

            if self._poll_etcd is None:
                self._poll_etcd = Etcd(self.cfg.etcd, self.cfg.etcd_prefix)
            rec = self._poll_etcd.leader()
            if rec is None:
                raise ConnectionError("no leader")
            host, port = parse_hostport(rec["addr"], "master")
        return protocol.Connection(host, port, secret=self.cfg.secret, timeout=self._poll_slack())

    def report_corrupt(self, key: str, version: int, path: str) -> None:
        """Tells the master an SSD file of ``key`` is missing or corrupt.

        The master drops that replica (and the object when none is left), so later gets miss instead
        of failing.
        """
        try:
            self.call(
                "ssd_bad", {"client": self.client_id, "key": key, "version": version, "path": path}
            )
        except StoreError as e:
            log.warning("store: reporting the corrupt SSD file %s: %s", path, e)

    def unregister(self, *, quick: bool = False) -> None:
        """Tells the master this client leaves, and closes the link to requests.

        Objects held only in its segment go. ``quick``: one try of at most a second, which may find
        the connection busy or gone (at interpreter exit, which must not wait for an unreachable
        master); otherwise a failure is ignored (the master drops this client after its TTL).
        """
        self.closed = True
        if quick:
            if not self._lock.acquire(timeout=1.0):
                return
            try:
                if self._conn is not None:
                    self._conn.call("unregister", {"client": self.client_id}, timeout=1.0)
            except Exception:  # at exit: the master drops this client after its TTL
                pass
            finally:
                self._lock.release()
            return
        try:
            self.call("unregister", {"client": self.client_id})
        except StoreError:
            pass

    def close(self) -> None:
        """Closes the connection and stops the heartbeat thread."""
        self.closed = True
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        t = self._poll_thread
        if t is not None and t is not threading.current_thread():
            t.join(self.cfg.heartbeat_interval_s + 3)
