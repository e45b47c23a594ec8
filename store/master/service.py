"""The store master: metadata RPC over asyncio streams, heartbeats, eviction, metrics, election.

Leader election is with etcd.

Run as a service::

    mooncake-store-master --port 50051 [--etcd 127.0.0.1:2379] [--metrics-port 9003]
    python -m mooncake_store.master ...

or embedded (``MooncakeStore()`` without a master address starts one in-process).
Why msgpack over asyncio streams (and not pyzmq or gRPC): one small, well-kept C-accelerated
dependency that decodes plain data only; the frame limit is checked on the 4-byte length
before any body byte is buffered; one event loop owns all metadata, so no locks; a
blocking socket on the client side costs one round trip per call.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
import uuid

from ..common import protocol
from ..common.errors import AuthError, NotLeaderError, ProtocolError, StoreError
from .config import MasterConfig
from .core import TICK_S, Core
from .ha import client_record, load_into, obj_record
from .metrics import CONTENT_TYPE, Metrics

log = logging.getLogger("mooncake_store.master")
_LEN = struct.Struct(">I")
_POLL_MAX_S = 2.0
_INF = float("inf")


def _loop_factory():
    """The event loop: uvloop's when installed (a faster drop-in), else asyncio's default."""
    from ..common.config import env_value

    if env_value("no_uvloop"):
        return None
    try:
        import uvloop

        return uvloop.new_event_loop
    except ImportError:
        return None


def _run(coro):
    factory = _loop_factory()
    if hasattr(asyncio, "Runner"):  # Python 3.11+
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(coro)
    loop = factory() if factory else asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        loop.close()


class Master:
    """One store master, embedded in a process or run as a service.

    ``start()`` serves on a background thread (embedded use and tests); ``run()`` serves on the
    calling thread until ``stop()`` or a signal (the CLI).

    Raises ``OSError`` if the port cannot be bound, ``ValueError`` for bad options.
    """

    def __init__(self, config: MasterConfig | None = None, **kw):
        self.cfg = config or MasterConfig(**kw)
        self.core = Core(self.cfg)
        self.id = uuid.uuid4().hex
        self.leader = self.cfg.etcd is None
        # with etcd: until when (time.monotonic()) this master's leader lease is certainly
        # alive (the send time of its last successful keep-alive + the lease's TTL)
        self._lease_until = float("inf") if self.cfg.etcd is None else -1.0
        self.leader_addr: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server = None
        self._metrics_server = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop_evt: asyncio.Event | None = None
        self._startup_error: BaseException | None = None
        self._elect_thread: threading.Thread | None = None
        self._etcd = None  # the loop thread's etcd client (record writes)
        self._closing = False
        self.port = 0
        self.metrics_port = 0
        self._conns = 0
        self._ident = ""
        self._spin_s = self.cfg.busy_poll_us / 1e6
        self._last_request = 0.0  # time.perf_counter() when the last request arrived
        self._spinning = False  # a _spin callback is queued
        self._requests = self._requests_seen = 0  # reads of requests; as of the last _spin turn
        self._last_conn = None  # the connection of the last request
        self._install_core(self.core)
        # read at each scrape: the core in use then (a new leader installs its own)
        self.metrics = Metrics(lambda: (self.core.stats(), self.leader))

    # ----------------------------------------------------------------- lifecycle
    @property
    def address(self) -> str:
        """``HOST:PORT`` clients use."""
        return self.cfg.advertise or f"{self.cfg.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> Master:
        """Serves on a background thread; returns this master once it listens.

        Raises ``TimeoutError`` when it has not started within ``timeout`` seconds, and the error it
        failed to start with (``OSError`` if a port cannot be bound).
        """
        self._thread = threading.Thread(
            target=self._thread_main, name="mooncake-store-master", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("store master did not start")
        if self._startup_error:
            raise self._startup_error
        return self

    def _thread_main(self):
        try:
            _run(self._main())
        except BaseException as e:  # pragma: no cover - reported through start()
            self._startup_error = e
            self._ready.set()

    def run(self) -> None:
        """Serves until SIGINT/SIGTERM. Raises ``OSError`` if a port cannot be bound."""
        _run(self._main(install_signals=True))
        if self._startup_error:
            raise self._startup_error

    def stop(self) -> None:
        """Stops serving and waits (up to 10 s) for the background thread to end."""
        self._closing = True
        if self.loop is not None and self._stop_evt is not None:
            try:
                self.loop.call_soon_threadsafe(self._stop_evt.set)
            except RuntimeError:
                pass
        if self._thread is not None:
            self._thread.join(10)

    async def _main(self, install_signals=False):
        self.loop = asyncio.get_running_loop()
        self._stop_evt = asyncio.Event()
        try:
            self._server = await self.loop.create_server(
                lambda: _Connection(self), self.cfg.host, self.cfg.port, reuse_address=True
            )
            self.port = self._server.sockets[0].getsockname()[1]
            if self.cfg.metrics_port is not None:
                self._metrics_server = await asyncio.start_server(
                    self._metrics_http, self.cfg.host, self.cfg.metrics_port
                )
                self.metrics_port = self._metrics_server.sockets[0].getsockname()[1]
        except BaseException as e:
            self._startup_error = e
            self._ready.set()
            return
        if install_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.loop.add_signal_handler(sig, self._stop_evt.set)
        if self.cfg.etcd:
            from ..common.etcd import Etcd

            self._etcd = Etcd(self.cfg.etcd, self.cfg.etcd_prefix)
            self._ident = json.dumps({"addr": self.address, "id": self.id})
            self._elect_thread = threading.Thread(
                target=self._elect_main, name="mooncake-store-elect", daemon=True
            )
            self._elect_thread.start()
        ticker = asyncio.ensure_future(self._ticker())
        log.info(
            "store master listening on %s (%s)",
            self.address,
            "leader" if self.leader else "standby",
        )
        self._ready.set()
        await self._stop_evt.wait()
        self._closing = True
        ticker.cancel()
        self._server.close()
        if self._metrics_server:
            self._metrics_server.close()
        if self.leader and self.cfg.etcd and getattr(self, "_lease", None) is not None:
            try:
                self._lease.revoke()
            except Exception:
                pass

    def _install_core(self, core: Core):
        self.core = core
        core.records.track_dirty = self.cfg.etcd is not None

        def notify(client):
            if client.event is not None:
                client.event.set()

        core.records.notify = notify

    # ----------------------------------------------------------------- election
    def _elect_main(self):
        from ..common.etcd import Etcd, describe

        etcd = Etcd(self.cfg.etcd, self.cfg.etcd_prefix)
        ttl = int(self.cfg.leader_ttl_s)
        fails, said, said_at = 0, "", 0.0
        while not self._closing:
            try:
                t = time.monotonic()
                lease = etcd.campaign(self._ident, ttl)
                if lease is None:
                    rec = etcd.leader()
                    self.leader_addr = rec["addr"] if rec else None
                    time.sleep(0.2)
                    continue
                self._lease = lease
                clients, objs = etcd.load()
                core = Core(self.cfg)
                load_into(core.records, clients, objs)
                self._lease_until = t + ttl
                fut = asyncio.run_coroutine_threadsafe(self._become_leader(core), self.loop)
                fut.result(30)
                log.warning(
                    "store master %s leads (%d objects, %d clients loaded from etcd)",
                    self.address,
                    len(core.records.objects),
                    len(core.records.clients),
                )
                last_ok = time.monotonic()
                while not self._closing and self.leader:
                    time.sleep(ttl / 4)
                    try:
                        t = time.monotonic()
                        if etcd.refresh(lease):
                            last_ok = time.monotonic()
                            self._lease_until = t + ttl
                        else:
                            break
                    except Exception:
                        if time.monotonic() - last_ok > ttl:
                            break
                if not self._closing:
                    log.warning("store master %s lost its leadership", self.address)
                    asyncio.run_coroutine_threadsafe(self._step_down(), self.loop).result(30)
                    try:  # let a standby (or this master, with a fresh load) lead at once
                        lease.revoke()
                    except Exception:
                        pass
            except Exception as e:  # etcd unreachable: retry (said once, then every 30 s)
                fails += 1
                why = describe(e)
                if why != said or time.monotonic() - said_at > 30:
                    log.warning(
                        "etcd %s: %s (try %d; retrying every 0.5 s)", self.cfg.etcd, why, fails
                    )
                    said, said_at = why, time.monotonic()
                time.sleep(0.5)

    async def _become_leader(self, core: Core):
        self._install_core(core)
        self.leader = True
        self.leader_addr = self.address

    def _lease_left(self) -> float:
        """Seconds this master certainly still leads (inf without etcd; <= 0: maybe not)."""
        return self._lease_until - _LEASE_MARGIN_S - time.monotonic()

    def _check_lease(self):
        """Raises ``NotLeaderError`` unless this master's leader lease is certainly alive.

        A leader that was stopped (SIGSTOP, a stalled VM) or cut off from etcd past its lease may
        have a successor; until a keep-alive succeeds again it answers nothing (a leader resumed
        after a stop would otherwise answer requests queued meanwhile from its old metadata: a get
        could return another object's bytes, and a put reservation it hands out could overwrite an
        object the new leader placed there).
        """
        if self._lease_left() <= 0:
            raise NotLeaderError(
                "this master's leader lease may have run out (it was stopped or cut off from etcd); "
                "ask the leader again"
            )

    async def _step_down(self):
        self.leader = False
        self._install_core(Core(self.cfg))

    def _flush(self):
        """Writes the etcd record of everything the last request changed (leader only)."""
        records = self.core.records
        if not records.track_dirty or not (records.dirty_objs or records.dirty_clients):
            return
        objs, clients = records.take_dirty()
        puts, deletes = {}, []
        for key, obj in objs.items():
            k = self._etcd.obj_key(key)
            if obj is None:
                deletes.append(k)
            else:
                puts[k] = obj_record(obj, records.group_quota.get(obj.group))
        for cid, c in clients.items():
            k = self._etcd.client_key(cid)
            if c is None:
                deletes.append(k)
            else:
                puts[k] = client_record(c)
        try:
            ok = self._etcd.write(self._ident, puts, deletes)
            why = "lost its leadership"
        except Exception as e:  # etcd unreachable: the record may lag the memory, so step down
            ok, why = False, f"could not write to etcd ({type(e).__name__}: {e})"
        if not ok:
            self.leader = False
            self._install_core(Core(self.cfg))
            log.warning("store master %s %s; standing down", self.address, why)
            raise NotLeaderError(f"this master {why}; ask the leader again")

    # ----------------------------------------------------------------- serving
    def _spin(self):
        """Keeps the event loop polling for ``MasterConfig.busy_poll_us`` after the last request.

        A queued callback makes the loop poll with a zero timeout, so a request that follows
        soon is read at once instead of after a wake-up from ``epoll_wait``, which on a VM costs
        about as much as the whole answer. A turn that found no new request yields the core
        (``sched_yield``), so a client waiting to run on it is not held up; turns that keep
        finding requests do not (yielding on every turn, 8 clients on 2 cores waited
        230-300 us per call at the median instead of 100-130 us). A yield that ran another
        task for long (``protocol.YIELD_LOST_S``) ends the spin: on a shared core a spinner
        loses the priority a sleeper gets back at its wake-up.
        """
        if time.perf_counter() - self._last_request < self._spin_s:
            if self._requests == self._requests_seen:
                t = time.perf_counter()
                os.sched_yield()
                if time.perf_counter() - t > protocol.YIELD_LOST_S:
                    self._spinning = False  # the core is shared with other work: sleep
                    return
            self._requests_seen = self._requests
            self.loop.call_soon(self._spin)
        else:
            self._spinning = False

    async def _ticker(self):
        while True:
            await asyncio.sleep(TICK_S)
            if self.leader and self._lease_left() > 0:
                try:
                    self.core.tick()
                    self._flush()
                except StoreError as e:
                    log.warning("tick: %s", e)
                except Exception:
                    log.exception("tick failed")

    def _poll_wait(self, args: dict) -> float:
        """Seconds a poll request may wait for tasks (0: answer at once)."""
        c = (
            self.core.records.clients.get(args.get("client"))
            if isinstance(args.get("client"), str)
            else None
        )
        if c is None or c.tasks:
            return 0.0
        wait = args.get("wait_ms", 0)
        if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not (wait > 0):
            return 0.0
        return min(float(wait) / 1000.0, _POLL_MAX_S)

    async def _poll(self, args: dict, wait: float):
        core = self.core
        c = core.records.clients.get(args.get("client"))
        if c is not None:
            if c.event is None:
                c.event = asyncio.Event()
            c.event.clear()
            c.last_seen = core.records.clock()
            try:
                await asyncio.wait_for(c.event.wait(), wait)
            except asyncio.TimeoutError:
                pass
        if not self.leader or self.core is not core:
            raise NotLeaderError("leadership changed")
        self._check_lease()
        return core.poll(args)

    def _dispatch(self, method: str, args: dict):
        """Runs one request on the metadata (synchronously) and writes what it changed to etcd."""
        if method == "hello":
            return {}
        if method == "leader":
            return {
                "leader": self.leader,
                "addr": self.address if self.leader else self.leader_addr,
            }
        if method == "metrics":
            return {"text": self.metrics.text()}
        if not self.leader:
            raise NotLeaderError(f"this master is a standby; the leader is {self.leader_addr}")
        if self._lease_until != _INF:  # without etcd the lease never runs out
            self._check_lease()
        if method == "poll":
            result = self.core.poll(args)
        else:
            fn = _METHODS.get(method)
            if fn is None:
                raise ProtocolError(f"unknown method {method!r}")
            result = fn(self.core, args)
        if self.core.records.track_dirty:
            self._flush()
        if method in ("reserve", "put") and self.cfg.etcd is not None and isinstance(result, dict):
            # how long the client may still write into its put reservation unasked (see
            # client._Reservation.valid_until): as long as this master certainly leads
            result = dict(result, lv=max(0.0, self._lease_left()))
        return result

    async def _metrics_http(self, reader, writer):
        """``GET /metrics`` (or ``/``): the Prometheus text; other paths 404, other methods 405."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            parts = head.split(b"\r\n", 1)[0].split()
            path = parts[1].split(b"?", 1)[0] if len(parts) == 3 else b""
            if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD"):
                status, body = b"405 Method Not Allowed", b"only GET /metrics\n"
            elif path not in (b"/metrics", b"/"):
                status, body = b"404 Not Found", b"metrics are at /metrics\n"
            else:
                status, body = b"200 OK", self.metrics.text().encode()
            writer.write(
                b"HTTP/1.0 "
                + status
                + b"\r\nContent-Type: "
                + CONTENT_TYPE.encode()
                + b"\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + (body if parts[:1] != [b"HEAD"] else b"")
            )
            await writer.drain()
        except Exception:
            pass
        finally:
            writer.close()


_LEASE_MARGIN_S = 0.25  # a leader stops answering this long before its lease could have run out
AUTH_TIMEOUT_S = 10.0  # with a secret: a connection that has not authenticated by then is closed
FRAME_TIMEOUT_S = (
    30.0  # a frame whose first bytes arrived must be whole by then, or the connection is closed
)
PREAUTH_FRAME_BYTES = 4096  # the largest frame before authentication (a hello is ~60 bytes)


class _Connection(asyncio.Protocol):
    """One client connection: frames are cut out of the byte stream and answered in order.

    Frames are cut out as they arrive. A frame longer than the limit gets an error reply and the
    connection is closed before its body is buffered. While a long poll waits, or the peer does not
    read its replies, reading from the connection is paused.
    """

    def __init__(self, master: Master):
        self.m = master
        self.buf = bytearray()
        self.transport = None
        self.nonce = os.urandom(32)
        self.authed = not master.cfg.secret
        self.busy = False  # a poll is waiting: later frames wait their turn
        self._poll_task: asyncio.Future | None = None  # held: the loop keeps only weak references
        self.write_paused = False
        self.closed = False
        # puts this connection started (put_start) and did not end: key -> [client, version]
        self.started: dict = {}
        self._auth_timer = None
        self._frame_timer = None

    def connection_made(self, transport):
        self.transport = transport
        self.m._conns += 1
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        if self.m._conns > 4096:
            self._send([-1, 1, [ProtocolError.code, "too many connections"]])
            self._close()
            return
        self._send([0, 0, {"v": protocol.VERSION, "nonce": self.nonce, "auth": not self.authed}])
        if not self.authed:  # idle unauthenticated connections must not fill the connection cap
            self._auth_timer = self.m.loop.call_later(
                AUTH_TIMEOUT_S, self._timeout, f"not authenticated within {AUTH_TIMEOUT_S:g} s"
            )

    def _timeout(self, why: str):
        if not self.closed:
            self._send([-1, 1, [ProtocolError.code, f"{why}; closing"]])
            self._close()

    def _frame_timeout(self):
        self._frame_timer = None
        if self.busy or self.write_paused:  # reading is paused by us, not by a slow peer: wait on
            self._frame_timer = self.m.loop.call_later(FRAME_TIMEOUT_S, self._frame_timeout)
            return
        self._timeout(f"frame not complete within {FRAME_TIMEOUT_S:g} s")

    def connection_lost(self, exc):
        self.closed = True
        self.m._conns -= 1
        for t in (self._auth_timer, self._frame_timer):
            if t is not None:
                t.cancel()
        # A put started on this connection and not ended here is aborted: its writer gave up
        # on the connection (a timeout, e.g. while this master was stopped, whose put_start
        # is then only handled now), and would otherwise find its own key "being written"
        # until put_ttl_s when it tries again. A writer that only lost the connection
        # between the two requests gets PutLost from put_end and puts it again by itself;
        # its space is kept for a lease TTL, in case that writer is still copying into it.
        if self.m.leader:
            for key, (cid, version) in self.started.items():
                self.m.core.abort_puts(cid, [[key, version]], grace_s=self.m.cfg.lease_ttl_s)
        self.started = {}

    def pause_writing(self):
        self.write_paused = True
        self.transport.pause_reading()

    def resume_writing(self):
        self.write_paused = False
        if not self.busy and not self.closed:
            self.transport.resume_reading()
            self._process()

    def _send(self, obj):
        if not self.closed:
            self.transport.write(protocol.pack(obj))

    def _close(self):
        self.closed = True
        self.transport.close()

    def data_received(self, data):
        m = self.m
        if m._spin_s:
            m._last_request = time.perf_counter()
            m._requests += 1
            # only while one connection keeps the master busy: with several, their requests
            # queue up and keep it awake anyway, and a spin only takes their clients' cores
            if m._last_conn is self:
                if not m._spinning:
                    m._spinning = True
                    m.loop.call_soon(m._spin)
            else:
                m._last_conn = self
                m._last_request = 0.0  # a queued _spin stops
        # the common case, one whole request in one read, is answered without buffering it
        if (
            not self.buf
            and self.authed
            and not self.busy
            and not self.write_paused
            and not self.closed
            and len(data) >= 4
        ):
            n = _LEN.unpack_from(data, 0)[0]
            if len(data) == 4 + n and n <= self.m.cfg.max_frame_bytes:
                self._request(memoryview(data)[4:])
                return
        self.buf += data
        self._process()

    def _process(self):
        while not self.busy and not self.closed and not self.write_paused:
            # before authentication only a small frame (the hello) is buffered
            limit = self.m.cfg.max_frame_bytes if self.authed else PREAUTH_FRAME_BYTES
            n = _LEN.unpack_from(self.buf, 0)[0] if len(self.buf) >= 4 else 0
            if n > limit:
                self._send(
                    [
                        -1,
                        1,
                        [
                            ProtocolError.code,
                            f"frame of {n} bytes exceeds the limit of {limit}"
                            + ("" if self.authed else " before authentication")
                            + "; closing",
                        ],
                    ]
                )
                self._close()
                return
            if len(self.buf) < 4 or len(self.buf) < 4 + n:
                # a frame begun: it must be whole within FRAME_TIMEOUT_S (its bytes stay buffered)
                if self.buf and self._frame_timer is None:
                    self._frame_timer = self.m.loop.call_later(FRAME_TIMEOUT_S, self._frame_timeout)
                return
            if self._frame_timer is not None:
                self._frame_timer.cancel()
                self._frame_timer = None
            body = self.buf[4 : 4 + n]
            del self.buf[: 4 + n]
            self._request(body)

    def _request(self, body):
        mid = -1
        try:
            req = protocol.unpack(body)
            if not (
                isinstance(req, list)
                and len(req) == 3
                and isinstance(req[0], int)
                and not isinstance(req[0], bool)
                and isinstance(req[1], str)
                and isinstance(req[2], dict)
            ):
                if (
                    isinstance(req, list)
                    and req
                    and isinstance(req[0], int)
                    and not isinstance(req[0], bool)
                ):
                    mid = req[0]
                raise ProtocolError("a request must be [id, method, {args}]")
            mid, method, args = req
            if not self.authed:
                if method != "hello":
                    self._send(
                        [
                            mid,
                            1,
                            [
                                AuthError.code,
                                "authenticate first (hello with the shared secret's HMAC)",
                            ],
                        ]
                    )
                    self._close()
                    return
                m = args.get("mac")
                if not (
                    isinstance(m, bytes)
                    and hmac.compare_digest(m, protocol.mac(self.m.cfg.secret, self.nonce))
                ):
                    self._send([mid, 1, [AuthError.code, "wrong shared secret"]])
                    self._close()
                    return
                self.authed = True
                if self._auth_timer is not None:
                    self._auth_timer.cancel()
                    self._auth_timer = None
                reply = [mid, 0, {}]
            elif method == "poll" and self.m.leader and self.m._poll_wait(args) > 0:
                self.busy = True
                self.transport.pause_reading()
                self._poll_task = asyncio.ensure_future(
                    self._finish_poll(mid, args, self.m._poll_wait(args))
                )
                return
            else:
                reply = [mid, 0, self.m._dispatch(method, args)]
                if method == "put_start":
                    for it, res in zip(args["items"], reply[2]["items"]):
                        if res[0] == 0:
                            self.started[it[0]] = [args["client"], res[1]]
                elif method in ("put_end", "put_revoke"):
                    for it in args["items"]:
                        if isinstance(it, list) and it and isinstance(it[0], str):
                            self.started.pop(it[0], None)
        except StoreError as e:
            reply = [mid, 1, [e.code, str(e)]]
        except Exception as e:  # a bug: report, keep serving
            log.exception("request failed")
            reply = [mid, 1, ["StoreError", f"internal error: {type(e).__name__}: {e}"]]
        self._send(reply)

    async def _finish_poll(self, mid, args, wait):
        try:
            reply = [mid, 0, await self.m._poll(args, wait)]
        except StoreError as e:
            reply = [mid, 1, [e.code, str(e)]]
        except Exception as e:
            log.exception("poll failed")
            reply = [mid, 1, ["StoreError", f"internal error: {type(e).__name__}: {e}"]]
        self._send(reply)
        self.busy = False
        if not self.closed:
            if not self.write_paused:
                self.transport.resume_reading()
            self._process()


_METHODS = {
    "register": Core.register,
    "unregister": Core.unregister,
    "put_start": Core.put_start,
    "put": Core.put,
    "reserve": Core.reserve,
    "put_end": Core.put_end,
    "put_revoke": Core.put_revoke,
    "get": Core.get,
    "exists": Core.exists,
    "where": Core.where,
    "remove": Core.remove,
    "offload_done": Core.offload_done,
    "load_done": Core.load_done,
    "adopt_ssd": Core.adopt_ssd,
    "ssd_bad": Core.ssd_bad,
    "promote": Core.promote,
    "invalidate": Core.invalidate,
    "tag": Core.tag,
    "history": Core.history,
    "list_prefixes": Core.list_prefixes,
    "remove_prefix": Core.remove_prefix,
    "hold": Core.hold,
    "release": Core.release,
    "stats": lambda core, a: core.stats(),
}


def main(argv: list[str] | None = None) -> int:
    """``mooncake-store-master``'s entry point: parses ``argv`` and serves until SIGINT/SIGTERM.

    Returns 1 when it cannot listen; bad options exit through ``argparse``'s error. ``--port-file``
    gets ``'PORT METRICS_PORT'`` once the master listens.
    """
    p = argparse.ArgumentParser(
        prog="mooncake-store-master", description="Metadata master of mooncake_store."
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="RPC port (default 50051; 0: ephemeral)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics over HTTP on this port",
    )
    p.add_argument(
        "--etcd", default=None, help="HOST:PORT of etcd: elect a leader, keep metadata there"
    )
    p.add_argument("--etcd-prefix", default="/mooncake_store/default")
    p.add_argument("--advertise", default=None, help="HOST:PORT clients should use for this master")
    p.add_argument(
        "--client-ttl",
        type=float,
        default=5.0,
        help="seconds without heartbeat before a client is dead",
    )
    p.add_argument("--lease-ttl", type=float, default=5.0, help="read lease, seconds")
    p.add_argument("--put-ttl", type=float, default=60.0, help="seconds a put may stay unfinished")
    p.add_argument("--high-watermark", type=float, default=0.95)
    p.add_argument("--low-watermark", type=float, default=0.85)
    p.add_argument("--leader-ttl", type=int, default=2, help="etcd lease of the leader, seconds")
    p.add_argument("--max-frame-bytes", type=int, default=4 << 20)
    p.add_argument(
        "--history-entries",
        type=int,
        default=100_000,
        help="dropped keys whose cause the master remembers (0: none)",
    )
    p.add_argument(
        "--orphan-grace",
        type=float,
        default=30.0,
        help="seconds an object found on SSD may wait for its parent before it is dropped",
    )
    p.add_argument(
        "--eviction-policy",
        choices=("lru", "lfu"),
        default="lru",
        help="which objects memory eviction takes first (default lru)",
    )
    p.add_argument(
        "--busy-poll-us",
        type=int,
        default=60,
        help="microseconds to keep polling without sleeping after a request (default 60; 0: off)",
    )
    p.add_argument(
        "--port-file",
        default=None,
        help="once listening, write 'PORT METRICS_PORT' here (METRICS_PORT 0 without --metrics-port)",
    )
    a = p.parse_args(argv)
    from ..common.config import env_value

    secret = env_value("secret")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = MasterConfig(
            host=a.host,
            port=a.port,
            secret=secret,
            client_ttl_s=a.client_ttl,
            lease_ttl_s=a.lease_ttl,
            put_ttl_s=a.put_ttl,
            high_watermark=a.high_watermark,
            low_watermark=a.low_watermark,
            metrics_port=a.metrics_port,
            etcd=a.etcd,
            etcd_prefix=a.etcd_prefix,
            leader_ttl_s=a.leader_ttl,
            advertise=a.advertise,
            max_frame_bytes=a.max_frame_bytes,
            history_entries=a.history_entries,
            orphan_grace_s=a.orphan_grace,
            eviction_policy=a.eviction_policy,
            busy_poll_us=a.busy_poll_us,
        )
    except ValueError as e:
        p.error(str(e))
    if a.port_file:  # a supervisor waits for this file: a master that cannot write it stops
        try:
            with open(a.port_file + ".tmp", "w"):
                pass
            os.remove(a.port_file + ".tmp")
        except OSError as e:
            p.error(f"--port-file: cannot write {a.port_file}.tmp: {e}")
    m = Master(cfg)
    if a.port_file:

        def write_port():
            m._ready.wait()
            if m._startup_error:
                return
            tmp = a.port_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(f"{m.port} {m.metrics_port}\n")
            os.replace(tmp, a.port_file)

        threading.Thread(target=write_port, daemon=True).start()
    try:
        m.run()
    except OSError as e:
        print(
            f"mooncake-store-master: cannot listen on {cfg.host} (port {cfg.port}, metrics port "
            f"{cfg.metrics_port}): {e}",
            file=sys.stderr,
        )
        return 1
    return 0
