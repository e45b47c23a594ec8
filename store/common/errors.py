"""Errors of ``mooncake_store``.

Every error the store raises derives from :class:`StoreError`. Errors travel from the
master to clients as ``(code, message)`` pairs (never pickled); :func:`from_code` turns
a code back into the class below, so a client raises the same type the master meant.
:func:`short_repr` keeps the names messages quote short.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every ``mooncake_store`` error."""

    code = "StoreError"


class ObjectExistsError(StoreError):
    """A plain ``put`` on a key that exists (or is being written); use ``upsert``."""

    code = "ObjectExists"


class ObjectNotFoundError(StoreError, KeyError):
    """The key does not exist, or no complete version of it exists yet (a put is in progress).

    A ``KeyError``, distinct from an empty value (``b""``).
    """

    code = "ObjectNotFound"

    def __str__(self):  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class LeaseExpiredError(StoreError):
    """A read took longer than its lease: the bytes may have been evicted meanwhile.

    They are therefore not returned (the caller's buffer may hold partial data only for
    ``get_into``, which says so).
    """

    code = "LeaseExpired"


class ObjectHasLeaseError(StoreError):
    """``remove`` of an object that a reader holds a lease on.

    Wait for the lease to expire or pass ``force=True``.
    """

    code = "ObjectHasLease"


class ReplicaShortfallError(StoreError):
    """Fewer segments than ``replica_num`` could take the object, and all were required.

    ``ReplicateConfig(require_all=True)`` asked for all of them; nothing was stored.
    """

    code = "ReplicaShortfall"


class NoSpaceError(StoreError):
    """No segment can hold the object and nothing can be evicted, or no segment is registered.

    Nothing can be evicted when everything is leased, pinned or being written.
    """

    code = "NoSpace"


class TransferError(StoreError):
    """Moving bytes to or from a segment failed (its owner died, a TCP peer went away)."""

    code = "Transfer"


class ProtocolError(StoreError):
    """A malformed, oversized or unauthenticated message."""

    code = "Protocol"


class AuthError(ProtocolError):
    """The shared secret did not match, or the master requires one and none was given."""

    code = "Auth"


class NotLeaderError(StoreError):
    """This master is a standby (or lost its leadership); ask the leader."""

    code = "NotLeader"


class UnknownClientError(StoreError):
    """The master does not know this client (it restarted, or declared the client dead).

    The client registers again.
    """

    code = "UnknownClient"


class PutLostError(StoreError):
    """The put this request refers to is unknown to the master.

    Its writer was declared dead, or a new leader never saw it. The client redoes the whole put
    once.
    """

    code = "PutLost"


class ParentMissingError(StoreError):
    """A put names a ``parent`` key that is not stored (never put, or dropped meanwhile).

    Nothing was stored for it: put the parent first.
    """

    code = "ParentMissing"


class InvalidatedError(StoreError):
    """A put carried a tag that ``invalidate`` dropped while the put was being written.

    Nothing was stored for it: whatever its writer computed belongs to what was invalidated.
    """

    code = "Invalidated"


class StaleVersionError(StoreError):
    """WeightSync: a publish at or below the latest committed version, or a pull going back.

    A publish at or below the latest committed version of the model (the trainer resumes numbering
    above it), or a pull of a version older than the one the reader holds (readers never go back).
    """

    code = "StaleVersion"


class WeightSyncAbortedError(StoreError):
    """WeightSync: an update did not complete; the previous version is still installed.

    A participant failed while staging it, a piece is missing or its checksum is wrong.
    """

    code = "WeightSyncAborted"


_ALL = [
    StoreError,
    ObjectExistsError,
    ObjectNotFoundError,
    LeaseExpiredError,
    ObjectHasLeaseError,
    ReplicaShortfallError,
    NoSpaceError,
    TransferError,
    ProtocolError,
    AuthError,
    NotLeaderError,
    UnknownClientError,
    PutLostError,
    ParentMissingError,
    InvalidatedError,
    StaleVersionError,
    WeightSyncAbortedError,
]
_BY_CODE = {c.code: c for c in _ALL}


def from_code(code: str, message: str) -> StoreError:
    """The exception of ``code`` (``StoreError`` for unknown codes) with ``message``.

    ``"NoSpaceRetry"`` (space that frees up by itself soon) is a ``NoSpaceError`` whose
    ``code`` says so.
    """
    if code == "NoSpaceRetry":
        e = NoSpaceError(message)
        e.code = code
        return e
    return _BY_CODE.get(code, StoreError)(message)


def code_of(exc: BaseException) -> str:
    """The wire code of ``exc``: its ``code`` for a :class:`StoreError`, else ``"StoreError"``."""
    return exc.code if isinstance(exc, StoreError) else "StoreError"


def short_repr(text: str) -> str:
    """``repr(text)``, cut to its first 80 characters (and its length said).

    Used in a message that names a key, model or tenant.
    """
    return repr(text) if len(text) <= 80 else repr(text[:80]) + f"... ({len(text)} chars)"
