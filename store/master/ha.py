"""High availability: the master's metadata record in etcd.

Election and keys are in ``common/etcd.py``.

* ``prefix/c/<client id>``: a client and its segment descriptors (JSON).
* ``prefix/o/<hex of key>``: one committed object (JSON: size, version, metadata,
  replicas). Written by the leader before it answers the put/remove/evict that changed
  it (``Master._flush``).

A new leader loads the record, so object metadata survives a leader change; leases and
puts in progress do not (their writers redo the put).
"""

from __future__ import annotations

import base64
import json

from .records import Client, Obj, Records, Segment


def client_record(c: Client) -> str:
    """The etcd record of client ``c`` and its segment descriptors (JSON)."""
    segs = []
    for s in c.segments:
        segs.append(s.desc)
    return json.dumps(
        {
            "id": c.id,
            "name": c.name,
            "host": c.host,
            "pid": c.pid,
            "ssd_dir": c.ssd_dir,
            "ssd_max": c.ssd_max,
            "segs": segs,
        }
    )


def obj_record(o: Obj) -> str:
    """The etcd record of committed object ``o`` (JSON: size, version, metadata, replicas).

    Metadata is base64; the record also holds the key, the SSD replicas and the pin.
    """
    return json.dumps(
        {
            "k": o.key,
            "s": o.size,
            "v": o.version,
            "m": base64.b64encode(o.meta).decode(),
            "r": o.repl,
            "d": o.ssd,
            "p": o.pin,
        }
    )


def decode_obj(rec: dict) -> tuple:
    """``(key, size, version, meta, replicas, ssd replicas, pin)`` of an object's record.

    The record is one :func:`obj_record` wrote, parsed from JSON.
    """
    return (
        rec["k"],
        rec["s"],
        rec["v"],
        base64.b64decode(rec["m"]),
        rec["r"],
        rec["d"],
        bool(rec["p"]),
    )


def load_into(records: Records, clients: list, objs: list) -> None:
    """Fills an empty core's ``records`` from the etcd record (a new leader).

    Every client gets a full ``client_ttl_s`` to send its next heartbeat; nothing is evicted for one
    lease TTL (readers' leases were not recorded).
    """
    now = records.clock()
    for rec in clients:
        try:
            ssd_max = rec.get("ssd_max")
            c = Client(
                rec["id"],
                rec["name"],
                rec["host"],
                int(rec["pid"]),
                rec.get("ssd_dir"),
                now,
                None if ssd_max is None else int(ssd_max),
            )
            for d in rec["segs"]:
                seg = Segment(d["name"], c, int(d["size"]), d)
                records.segments[seg.name] = seg
                c.segments.append(seg)
                records.capacity += seg.alloc.size
            records.clients[c.id] = c
        except (KeyError, TypeError, ValueError):
            continue
    used: dict = {}
    for rec in objs:
        try:
            key, size, version, meta, repl, ssd, pin = decode_obj(rec)
        except (KeyError, TypeError, ValueError):
            continue
        obj = Obj(key, size, version, meta, pin)
        obj.repl = [[s, int(off), int(n)] for s, off, n in repl if s in records.segments]
        obj.ssd = [[cid, p] for cid, p in ssd if cid in records.clients]
        if not obj.repl and not obj.ssd and size:  # empty objects need no replica
            continue
        for s, off, n in obj.repl:
            records.segments[s].add_key(key)
            used.setdefault(s, []).append((off, n))
        for cid, _ in obj.ssd:
            records.clients[cid].ssd_keys.add(key)
            records.clients[cid].ssd_bytes += size
        records.objects[key] = obj
        records.lru[key] = None
        records.see_version(version)
    for name, ranges in used.items():
        seg = records.segments[name]
        seg.alloc.rebuild(ranges)
        records.used += seg.alloc.used
    records.seg_epoch += 1
    records.no_evict_until = now + records.cfg.lease_ttl_s
