"""The records the master's metadata core keeps: a registered segment, a client, an
object (a committed version or a put in progress) and the counters of ``stats``.
"""

from __future__ import annotations

from ..common.layout import SEG_HEADER
from .alloc import Allocator


class Segment:
    __slots__ = ("alloc", "client", "desc", "keys", "name", "size")

    def __init__(self, name: str, client: Client, size: int, desc: dict):
        self.name = name
        self.client = client
        self.size = size
        self.alloc = (
            Allocator(size - SEG_HEADER, base=SEG_HEADER)
            if size > SEG_HEADER
            else Allocator(0, SEG_HEADER)
        )
        self.desc = desc
        # key -> replicas here (committed or pending): an upsert's new replica may share the
        # segment with the old one, and freeing the old must not forget the new
        self.keys: dict = {}

    def add_key(self, key: str) -> None:
        self.keys[key] = self.keys.get(key, 0) + 1

    def drop_key(self, key: str) -> None:
        n = self.keys.get(key, 0) - 1
        if n > 0:
            self.keys[key] = n
        else:
            self.keys.pop(key, None)


class Client:
    __slots__ = (
        "event",
        "host",
        "id",
        "last_put",
        "last_seen",
        "name",
        "pid",
        "reclaim_at",
        "reserved",
        "segments",
        "ssd_bytes",
        "ssd_dir",
        "ssd_failed_at",
        "ssd_inflight",
        "ssd_keys",
        "ssd_max",
        "tasks",
        "writing",
    )

    def __init__(
        self,
        cid: str,
        name: str,
        host: str,
        pid: int,
        ssd_dir: str | None,
        now: float,
        ssd_max: int | None = None,
    ):
        self.id = cid
        self.name = name
        self.host = host
        self.pid = pid
        self.ssd_dir = ssd_dir
        self.last_seen = now
        self.segments: list[Segment] = []
        self.tasks: list = []
        self.event = None  # asyncio.Event, set by the server
        self.writing: set = set()  # keys of pending puts this client writes
        self.ssd_keys: set = set()  # keys with an SSD replica in this client's directory
        self.ssd_max = ssd_max  # object bytes the directory may hold (None: no limit)
        self.ssd_bytes = 0  # object bytes on it, offloads in flight included
        self.ssd_inflight = 0  # of which offloads in flight (written, not yet reported)
        self.ssd_failed_at = (
            -1e18
        )  # when a write to it last failed (full disk: no offloads for a while)
        # put reservations: segment name -> [offset of the next byte, bytes left] (see Core.reserve)
        self.reserved: dict = {}
        self.reclaim_at = -1e18  # when it was last asked to give its reservations back
        self.last_put = None  # [request id, reply] of its last one-round-trip put (a resent request gets it again)


class Obj:
    __slots__ = (
        "deadline",
        "key",
        "lease_until",
        "loading",
        "meta",
        "offloading",
        "pin",
        "repl",
        "size",
        "ssd",
        "version",
        "want",
        "writer",
    )

    def __init__(self, key, size, version, meta, pin):
        self.key = key
        self.size = size
        self.version = version
        self.meta = meta
        self.repl: list = []  # [segment name, offset, allocated bytes]
        self.want = (
            1  # replicas a put asked for and could have (what a put of an empty object reports)
        )
        self.ssd: list = []  # [client id, path]
        self.pin = pin
        self.lease_until = 0.0
        self.writer = None
        self.deadline = 0.0
        self.offloading = False  # or the id of the client writing it to its SSD
        self.loading = None  # [segment, offset, bytes] being filled from SSD for remote readers


class Counters:
    def __init__(self):
        self.puts = self.gets = self.hits = self.misses = self.evictions = 0
        self.offloads = self.removes = self.put_aborts = self.clients_lost = self.ssd_drops = 0
        self.ssd_corrupt = 0
