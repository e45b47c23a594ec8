"""Requests of the master's metadata core over sets of keys.

They drop every object carrying a
tag (``invalidate``), list and drop keys by prefix (``list_prefixes``, ``remove_prefix``)
and say why keys were dropped (``history``). Each drop takes the objects that hang off
the dropped ones with it (``Records.drop``).

The prefix requests scan every committed key (O(objects) on the master's event loop:
0.05-0.3 s per million objects on a 2-core VM, from none to all of them under the
prefix): they are for operators and housekeeping, not for every request.
"""

from __future__ import annotations

from ..common.errors import ProtocolError
from .puts import MAX_TAG_BYTES, MAX_TAGS
from .records import Records


class Keyspace:
    """Tags, prefixes and the drop history."""

    def __init__(self, records: Records):
        self.records = records

    def invalidate(self, a: dict) -> dict:
        """The ``invalidate`` request: drops every committed object carrying any of ``tags``.

        The objects that hang off them go too, and leased, pinned or held ones as well (their
        memory is freed once the readers' leases end). An unknown tag drops nothing.

        Returns:
            ``{"dropped": objects dropped}``.
        """
        rec = self.records
        rec.client(a.get("client"))
        tags = a.get("tags")
        if not (
            isinstance(tags, list)
            and len(tags) <= rec.cfg.max_keys_per_call
            and all(isinstance(t, str) and t and len(t.encode()) <= MAX_TAG_BYTES for t in tags)
        ):
            raise ProtocolError(
                f"invalidate: tags must be a list of at most {rec.cfg.max_keys_per_call} "
                f"non-empty str of at most {MAX_TAG_BYTES} bytes"
            )
        n = 0
        seen = rec.tag_invalidated
        for t in dict.fromkeys(tags):
            for key in list(rec.tag_keys.get(t, ())):
                n += rec.drop(key, "invalidated", t)
            seen[t] = rec.invalidations_done
            seen.move_to_end(t)
        while len(seen) > 65536:
            seen.popitem(last=False)
        rec.invalidations_done += 1
        rec.counters.invalidations += 1
        return {"dropped": n}

    def tag(self, a: dict) -> dict:
        """The ``tag`` request: adds tags to committed objects.

        ``keys`` and ``tags`` (per key a list of tags) of equal length; keys that do not
        exist are skipped. The tags are kept in the master (and etcd), not in an SSD file
        written before.

        Returns:
            ``{"tagged": objects that got a new tag}``.
        """
        rec = self.records
        rec.client(a.get("client"))
        keys = rec.check_keys(a.get("keys"))
        tags = a.get("tags")
        if not (
            isinstance(tags, list)
            and len(tags) == len(keys)
            and all(
                isinstance(ts, list)
                and len(ts) <= MAX_TAGS
                and all(isinstance(t, str) and t and len(t.encode()) <= MAX_TAG_BYTES for t in ts)
                for ts in tags
            )
        ):
            raise ProtocolError(
                f"tag: tags must be one list per key of at most {MAX_TAGS} non-empty str of at "
                f"most {MAX_TAG_BYTES} bytes"
            )
        n = 0
        for key, ts in zip(keys, tags):
            obj = rec.objects.get(key)
            if obj is not None and ts:
                if len(set(obj.tags or ()) | set(ts)) > MAX_TAGS:
                    raise ProtocolError(f"tag: {key!r} would carry more than {MAX_TAGS} tags")
                n += rec.add_tags(obj, tuple(ts))
        return {"tagged": n}

    def history(self, a: dict) -> dict:
        """The ``history`` request: why each of ``keys`` was dropped.

        Returns:
            ``{"history": [...]}``: per key ``[cause, tier, unix_s, detail]`` of its last drop
            that this master remembers, or None (never dropped, stored again since, or
            forgotten).
        """
        rec = self.records
        keys = rec.check_keys(a.get("keys"))
        h = rec.history
        return {"history": [None if (e := h.get(k)) is None else list(e) for k in keys]}

    def _prefix(self, a: dict, op: str, *, empty: bool) -> str:
        prefix = a.get("prefix")
        if not isinstance(prefix, str) or (not prefix and not empty):
            raise ProtocolError(f"{op}: prefix must be a{'' if empty else ' non-empty'} str")
        if len(prefix.encode()) > self.records.cfg.max_key_bytes:
            raise ProtocolError(f"{op}: prefix longer than max_key_bytes")
        return prefix

    def list_prefixes(self, a: dict) -> dict:
        """The ``list_prefixes`` request: counts the committed keys under ``prefix`` by segment.

        The segment is the part of a key after ``prefix`` up to the first ``sep`` (the whole
        rest where there is none).

        Returns:
            ``{"prefixes": {segment: objects}}``.
        """
        prefix = self._prefix(a, "list_prefixes", empty=True)
        sep = a.get("sep", "/")
        if not (isinstance(sep, str) and sep and len(sep) <= 16):
            raise ProtocolError("list_prefixes: sep must be a non-empty str of at most 16 chars")
        out: dict = {}
        cut = len(prefix)
        for k in self.records.objects:
            if k.startswith(prefix):
                end = k.find(sep, cut)
                seg = k[cut:] if end < 0 else k[cut:end]
                out[seg] = out.get(seg, 0) + 1
        return {"prefixes": out}

    def remove_prefix(self, a: dict) -> dict:
        """The ``remove_prefix`` request: drops the committed objects under ``prefix``.

        Keys under any of ``keep`` are not chosen, but what hangs off a dropped object goes
        whatever its key; leased objects go too (freed after the leases).

        Returns:
            ``{"dropped": objects dropped}``.
        """
        rec = self.records
        rec.client(a.get("client"))
        prefix = self._prefix(a, "remove_prefix", empty=False)
        keep = a.get("keep", [])
        if not (
            isinstance(keep, list)
            and len(keep) <= 1024
            and all(isinstance(p, str) and p for p in keep)
        ):
            raise ProtocolError("remove_prefix: keep must be a list of at most 1024 non-empty str")
        keep_t = tuple(keep)
        doomed = [
            k for k in rec.objects if k.startswith(prefix) and not (keep_t and k.startswith(keep_t))
        ]
        n = 0
        for k in doomed:
            n += rec.drop(k, "removed", f"prefix {prefix}")
        rec.counters.removes += n
        return {"dropped": n}
