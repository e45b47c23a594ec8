"""The tasks the master hands a client with its heartbeats, run on a thread of their own.

The tasks: SSD offloads and loads, deletes of SSD files, and giving its put reservation back; and
giving an idle put reservation back by itself. They run on a thread of their own, apart from the
heartbeat thread: a long SSD write or an RPC stuck on a stopped master must not delay heartbeats
past the master's client TTL. Deletes run on a second thread (:class:`_Deleter`): on ext4 an
unlink of a file just made durable costs 0.1-1.2 ms here, and a full SSD tier deletes one file
per offload, which held the offloads (and the puts waiting for the memory they free) to the
pace of the unlinks.
"""

from __future__ import annotations

import logging
import os
import queue
import threading

from ..common.errors import StoreError, TransferError
from . import ssd
from .dataplane import DataPlane
from .link import Link
from .reservation import Reservations

log = logging.getLogger("mooncake_store")

MAX_OFFLOAD_BURST = 256  # offloads written with one syncfs and reported in one request, at most


class _Deleter:
    """Deletes SSD files on a thread of its own, in the order asked.

    A path still waiting here when an offload is about to write the same path is deleted first,
    by that offload (:meth:`settle`): the write never loses to an older delete. ``close`` waits
    for every delete asked for: a file left behind would come back as an object when the
    directory is scanned at the next start.
    """

    def __init__(self, ssd_dir: str):
        self._root = os.path.realpath(ssd_dir) + os.sep
        self._pending: set = set()  # paths asked for and not yet deleted
        self._lock = threading.Lock()  # held across each unlink: settle and the thread agree
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._main, name="mooncake-store-ssd-delete", daemon=True
        )
        self._thread.start()

    def put(self, path: str) -> None:
        """Queues the delete of ``path`` (ignored unless it lies under the SSD directory)."""
        if not os.path.realpath(path).startswith(self._root):
            return
        with self._lock:
            self._pending.add(path)
        self._queue.put(path)

    def settle(self, paths: list) -> None:
        """Deletes now those of ``paths`` whose delete is still queued (before they are written)."""
        with self._lock:
            for path in paths:
                if path in self._pending:
                    self._pending.discard(path)
                    ssd.delete(path)

    def close(self, timeout_s: float = 30.0) -> None:
        """Waits (at most ``timeout_s``) for the deletes queued so far, then stops the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _main(self):
        while True:
            path = self._queue.get()
            if path is None:
                return
            with self._lock:
                if path in self._pending:
                    self._pending.discard(path)
                    ssd.delete(path)


class Tasks:
    """Runs the master's tasks in order (:meth:`put` queues one; the heartbeat thread calls it)."""

    def __init__(
        self, link: Link, dataplane: DataPlane, reservations: Reservations, ssd_dir: str | None
    ):
        self._ssd_dir = ssd_dir  # StoreConfig.ssd_dir: where SSD files are written and deleted
        self._link = link
        self._dataplane = dataplane
        self._reservations = reservations
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._deleter = _Deleter(ssd_dir) if ssd_dir else None
        self._thread = threading.Thread(target=self._main, name="mooncake-store-tasks", daemon=True)
        self._thread.start()

    def put(self, task: list) -> None:
        """Queues ``task`` (a list whose first item names it) to run after those before."""
        self._queue.put(task)

    def close(self) -> None:
        """Stops the thread once the task it runs is done.

        An SSD load may be writing into the segment, which is closed next.
        """
        t = self._thread
        if t is not threading.current_thread():
            self._queue.put(None)
            t.join(30)
        if self._deleter is not None:
            self._deleter.close()

    def _main(self):
        link = self._link
        ahead = None  # a task taken from the queue behind a burst of offloads
        while not link.closed:
            if ahead is not None:
                task, ahead = ahead, None
            else:
                try:
                    task = self._queue.get(timeout=0.25)
                except queue.Empty:
                    task = None
            if task is None and link.closed:
                break
            try:
                if task is not None and task[0] == "offload":
                    # the offloads queued behind it go with it: their files are written in
                    # order and reported in one request (one round trip per eviction held the
                    # holder's task thread to about 1000 offloads/s on a 2-core VM)
                    burst = [task]
                    while len(burst) < MAX_OFFLOAD_BURST:
                        try:
                            nxt = self._queue.get_nowait()
                        except queue.Empty:
                            break
                        if nxt is None:  # close(): it stays the last task
                            self._queue.put(None)
                            break
                        if nxt[0] not in ("offload", "delete"):
                            ahead = nxt
                            break
                        burst.append(nxt)
                    self._offload(burst)
                elif task is not None:
                    self._run(task)
                self._reservations.give_back_if_idle()
            except Exception as e:
                if not link.closed:
                    log.warning(
                        "store: task %r failed: %s", task[0] if task else "reservation give-back", e
                    )

    def _run(self, task: list) -> None:
        op = task[0]
        if op == "unreserve":
            self._reservations.give_back(wait=True)
        elif op == "delete" and self._deleter is not None:
            self._deleter.put(task[1])
        elif op == "load" and self._dataplane.segment is not None:
            _, key, version, path, off, size = task
            ok, corrupt = False, False
            try:
                ssd.read_into(path, key, version, self._dataplane.segment.view[off : off + size])
                ok = True
            except TransferError as e:
                corrupt = isinstance(e, ssd.CorruptError)
                log.warning("store: loading %r from SSD failed: %s", key, e)
            try:
                self._link.call(
                    "load_done",
                    {"client": self._link.client_id, "key": key, "version": version, "ok": ok},
                )
            except StoreError as e:
                log.warning("store: load_done: %s", e)
            if corrupt:
                self._link.report_corrupt(key, version, path)
        elif op == "offload":
            self._offload([task])

    def _offload(self, tasks: list) -> None:
        """Runs ``offload`` (and ``delete``) tasks in order; reports the offloads in one request."""
        if self._dataplane.segment is None or not self._ssd_dir:
            return
        objs = []
        for task in tasks:
            if task[0] != "offload":
                self._run(task)
                continue
            _, key, version, off, size, meta, *links = task
            view = self._dataplane.segment.view[off : off + size]
            objs.append(
                (
                    key,
                    version,
                    meta,
                    view,
                    links[0] if links and isinstance(links[0], dict) else None,
                )
            )
        self._deleter.settle(
            [ssd.path_for(self._ssd_dir, key, version) for key, version, *_ in objs]
        )
        items = []
        for (key, version, *_), got in zip(objs, ssd.write_many(self._ssd_dir, objs)):
            if isinstance(got, OSError):
                log.warning("store: offload of %r failed: %s", key, got)
                items.append([key, version, "", False])
            else:
                items.append([key, version, got, True])
        if not items:
            return
        try:
            self._link.call("offload_done", {"client": self._link.client_id, "items": items})
        except StoreError as e:
            log.warning("store: offload_done: %s", e)
