"""How one store cluster lives in etcd: the leader key and the metadata record's keys.

Layout under ``prefix`` (``MasterConfig.etcd_prefix``, ``StoreConfig.etcd_prefix``):

* ``prefix/leader``: JSON ``{"addr": "HOST:PORT", "id": ...}`` of the leader, attached to
  its etcd lease (``leader_ttl_s``): when the leader dies the key vanishes with the lease
  and a standby creates it (a create-if-absent transaction). Clients read it to find the
  leader.
* ``prefix/c/<client id>`` and ``prefix/o/<hex of key>``: the master's metadata record
  (``master/ha.py``), written in transactions that check the leader key still holds the
  writer's id, so a deposed leader cannot overwrite its successor's record.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from .config import parse_hostport

TXN_OPS = 100  # below etcd's default --max-txn-ops (128)


def describe(e: BaseException) -> str:
    """``Type: message`` of an etcd client error.

    etcd3gw's ``ConnectionFailedError`` has an empty message, so the error it wraps (or a plain
    reading) says what happened.
    """
    text = str(e)
    inner = e.__cause__ or e.__context__
    if not text and inner is not None:
        text = f"{type(inner).__name__}: {inner}"
    return f"{type(e).__name__}: {text or 'no connection (nothing listens there, or no route)'}"


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


class Etcd:
    """A thin layer over ``etcd3gw`` (etcd's HTTP/JSON gateway).

    Each thread that talks to etcd should use its own instance (``requests`` sessions are not
    thread-safe).
    """

    def __init__(self, endpoint: str, prefix: str, timeout: float = 2.0):
        import etcd3gw

        host, port = parse_hostport(endpoint, "etcd")
        self.client = etcd3gw.Etcd3Client(host=host, port=port, timeout=timeout, api_path="/v3/")
        self.prefix = prefix.rstrip("/")
        self.leader_key = self.prefix + "/leader"

    # ---------------------------------------------------------------- election
    def campaign(self, ident: str, ttl: int) -> Any:
        """Tries to become leader: returns the lease (keep it alive with ``refresh``) or None."""
        lease = self.client.lease(ttl)
        if self.client.create(self.leader_key, ident, lease):
            return lease
        try:
            lease.revoke()
        except Exception:
            pass
        return None

    def refresh(self, lease: Any) -> bool:
        """Refreshes ``lease`` (from :meth:`campaign`); False when it has expired."""
        return lease.refresh() > 0

    def leader(self) -> dict | None:
        """The leader's record ``{"addr": ..., "id": ...}``, or None."""
        vals = self.client.get(self.leader_key)
        if not vals:
            return None
        try:
            rec = json.loads(vals[0])
            return rec if isinstance(rec, dict) and isinstance(rec.get("addr"), str) else None
        except ValueError:
            return None

    # ---------------------------------------------------------------- record
    def obj_key(self, key: str) -> str:
        """The etcd key of object ``key``'s record (the key hex-encoded under the prefix)."""
        return f"{self.prefix}/o/{key.encode().hex()}"

    def client_key(self, cid: str) -> str:
        """The etcd key of client ``cid``'s record."""
        return f"{self.prefix}/c/{cid}"

    def write(self, ident: str, puts: dict, deletes: list) -> bool:
        """Writes ``puts`` (etcd key -> str) and deletes ``deletes``, while ``ident`` still leads.

        The writes go in transactions that each check that ``ident`` still leads. False if it does
        not (nothing more written).
        """
        ops = [
            {"request_put": {"key": _b64(k.encode()), "value": _b64(v.encode())}}
            for k, v in puts.items()
        ]
        ops += [{"request_delete_range": {"key": _b64(k.encode())}} for k in deletes]
        cmp = [
            {
                "key": _b64(self.leader_key.encode()),
                "result": "EQUAL",
                "target": "VALUE",
                "value": _b64(ident.encode()),
            }
        ]
        for i in range(0, len(ops), TXN_OPS):
            res = self.client.transaction(
                {"compare": cmp, "success": ops[i : i + TXN_OPS], "failure": []}
            )
            if not res.get("succeeded"):
                return False
        return True

    def load(self) -> tuple[list, list]:
        """``(clients, objects)``: the JSON records under the prefix."""
        clients, objs = [], []
        for value, _meta in self.client.get_prefix(self.prefix + "/c/"):
            try:
                clients.append(json.loads(value))
            except ValueError:
                pass
        for value, _meta in self.client.get_prefix(self.prefix + "/o/"):
            try:
                objs.append(json.loads(value))
            except ValueError:
                pass
        return clients, objs
