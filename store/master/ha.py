"""High availability: the master's metadata record in etcd (election and keys:
``common/etcd.py``).

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .records import Client, Obj


def client_record(c: Client) -> str:
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
    return (
        rec["k"],
        rec["s"],
        rec["v"],
        base64.b64decode(rec["m"]),
        rec["r"],
        rec["d"],
        bool(rec["p"]),
    )
