"""High availability: the master's metadata record in etcd.

Election and keys are in ``common/etcd.py``.

* ``prefix/c/<client id>``: a client and its segment descriptors (JSON).
* ``prefix/o/<hex of key>``: one committed object (JSON: size, version, metadata,
  replicas, and where set its parent, tags, quota group and that group's quota). Written
  by the leader before it answers the put/remove/evict that changed it
  (``Master._flush``).

A new leader loads the record, so object metadata survives a leader change; leases,
puts in progress (their writers redo the put), holds and the drop history do not.
"""

from __future__ import annotations

import base64
import json
import sys

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


def obj_record(o: Obj, quota: int | None = None) -> str:
    """The JSON record of the committed ``o`` (``quota``: its group's)."""
    rec = {
        "k": o.key,
        "s": o.size,
        "v": o.version,
        "m": base64.b64encode(o.meta).decode(),
        "r": o.repl,
        "d": o.ssd,
        "p": o.pin,
    }
    if o.parent is not None:
        rec["pa"] = o.parent
    if o.tags:
        rec["t"] = list(o.tags)
    if o.group is not None:
        rec["g"] = o.group
        if quota is not None:
            rec["q"] = quota
    return json.dumps(rec)


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


def decode_links(rec: dict) -> tuple:
    """``(parent, tags, group, quota)`` of an object record (None where not set)."""
    parent, tags, group, quota = rec.get("pa"), rec.get("t"), rec.get("g"), rec.get("q")
    if not isinstance(parent, str):
        parent = None
    if isinstance(tags, list):
        tags = tuple(sys.intern(t) for t in tags if isinstance(t, str) and t) or None
    else:
        tags = None
    group = sys.intern(group) if isinstance(group, str) else None
    quota = quota if isinstance(quota, int) and quota > 0 else None
    return parent, tags, group, quota


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
    quotas: dict = {}  # group -> (version, quota) of its newest object that names one
    loaded: dict = {}
    for rec in objs:
        try:
            key, size, version, meta, repl, ssd, pin = decode_obj(rec)
            parent, tags, group, quota = decode_links(rec)
        except (KeyError, TypeError, ValueError):
            continue
        if quota is not None and quotas.get(group, (-1,))[0] < version:
            quotas[group] = (version, quota)
        obj = Obj(key, size, version, meta, pin, parent, tags, group)
        obj.repl = [[s, int(off), int(n)] for s, off, n in repl if s in records.segments]
        obj.ssd = [[cid, p] for cid, p in ssd if cid in records.clients]
        if not obj.repl and not obj.ssd and size:  # empty objects need no replica
            continue
        loaded[key] = obj
    # an object whose parent did not load (no live replica left) can never be found: it
    # is left out, with what hangs off it, and its record goes with this leader's first
    # write
    kids: dict = {}
    for o in loaded.values():
        if o.parent is not None:
            kids.setdefault(o.parent, []).append(o.key)
    lost = [k for k, o in loaded.items() if o.parent is not None and o.parent not in loaded]
    while lost:
        k = lost.pop()
        if loaded.pop(k, None) is not None:
            records.dirty_objs.add(k)
            lost.extend(kids.get(k, ()))
    used: dict = {}
    for key, obj in loaded.items():
        for s, off, n in obj.repl:
            records.segments[s].add_key(key)
            used.setdefault(s, []).append((off, n))
        for cid, _ in obj.ssd:
            records.clients[cid].ssd_keys.add(key)
            records.clients[cid].ssd_bytes += obj.size
        records.objects[key] = obj
        records.link(obj)
        records.see_version(obj.version)
    records.group_quota.update({g: q for g, (_, q) in quotas.items() if g in records.group_lru})
    for name, ranges in used.items():
        seg = records.segments[name]
        seg.alloc.rebuild(ranges)
        records.used += seg.alloc.used
    records.seg_epoch += 1
    records.no_evict_until = now + records.cfg.lease_ttl_s
