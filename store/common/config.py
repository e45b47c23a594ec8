"""Configuration every part of ``mooncake_store`` shares: the environment, addresses and host ids.

Addresses are ``HOST:PORT``. Every ``MOONCAKE_*`` environment variable the store reads is read here,
in :func:`env_defaults`, and nowhere else; explicit arguments always win over the environment. Each
part's options are a keyword-only dataclass next to it: ``StoreConfig`` and ``ReplicateConfig`` in
``client/config.py``, ``MasterConfig`` in ``master/config.py``, ``WeightSyncConfig`` in
``weight_sync/config.py``, ``KVCacheConfig`` in ``kvcache/config.py``.

| variable | meaning | default |
|---|---|---|
| ``MOONCAKE_STORE_MASTER`` | ``HOST:PORT`` of the master a client uses | embedded master |
| ``MOONCAKE_STORE_ETCD`` | ``HOST:PORT`` of etcd: clients find the leader there, masters elect one | off |
| ``MOONCAKE_STORE_ETCD_PREFIX`` | key prefix of one store cluster in etcd | ``/mooncake_store/default`` |
| ``MOONCAKE_STORE_SECRET`` | shared secret clients must prove (HMAC) to the master and to transfer engines | none |
| ``MOONCAKE_STORE_SEGMENT_SIZE`` | bytes of shared memory a client contributes (0: none) | 256 MiB |
| ``MOONCAKE_STORE_SSD_DIR`` | directory a client contributes as SSD tier | none |
| ``MOONCAKE_STORE_SSD_MAX_BYTES`` | bytes of object data a client's SSD directory may hold | unlimited |
| ``MOONCAKE_STORE_PUT_RESERVATION_BYTES`` | bytes a client asks to reserve for one-round-trip puts (0: off) | 64 MiB |
| ``MOONCAKE_STORE_RPC_BUSY_POLL_US`` | microseconds a client checks for a metadata reply without sleeping (0: always sleeps) | 200 with the embedded master, 0 with a master process |
| ``MOONCAKE_STORE_TUNE_MALLOC`` | ``0``: a client leaves glibc malloc's thresholds alone (``StoreConfig.tune_malloc``) | ``1`` |
| ``MOONCAKE_STORE_TRANSFER`` | ``auto`` (map same-host segments, TCP otherwise) or ``tcp`` (always TCP) | ``auto`` |
| ``MOONCAKE_HOST_ID`` | processes with equal ids count as one host and map each other's segments | hostname + boot id |
| ``MOONCAKE_SOCKET_IFNAME`` | interface the transfer engine listens on | interface routed to the master |
| ``MOONCAKE_STORE_NO_UVLOOP`` | ``1``: the master uses asyncio's own event loop even when uvloop is installed | off |
| ``MOONCAKE_STORE_TEST_PAUSE`` | tests only: ``put:SECONDS`` / ``get:SECONDS`` pauses after the master answered put-start / get, before any byte moves | off |
"""

from __future__ import annotations

import os
import socket

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def parse_hostport(value: str, what: str) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` (IPv6 hosts in brackets).

    Raises ``ValueError`` naming ``what`` otherwise.
    """
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 <= int(port) < 65536):
        raise ValueError(f"{what}: expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def default_host_id() -> str:
    """Hostname plus boot id: equal on every process of one boot of one machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "noboot"
    return f"{socket.gethostname()}/{boot}"


# variable -> StoreConfig field, taken as a string / as a whole number (and what it counts);
# StoreConfig.resolved names the variable a bad value came from
ENV_STR = {
    "MOONCAKE_STORE_MASTER": "master",
    "MOONCAKE_STORE_ETCD": "etcd",
    "MOONCAKE_STORE_ETCD_PREFIX": "etcd_prefix",
    "MOONCAKE_STORE_SECRET": "secret",
    "MOONCAKE_STORE_SSD_DIR": "ssd_dir",
    "MOONCAKE_STORE_TRANSFER": "transfer",
    "MOONCAKE_HOST_ID": "host_id",
    "MOONCAKE_SOCKET_IFNAME": "ifname",
}
ENV_INT = {
    "MOONCAKE_STORE_SEGMENT_SIZE": ("segment_size", "a byte count"),
    "MOONCAKE_STORE_SSD_MAX_BYTES": ("ssd_max_bytes", "a byte count"),
    "MOONCAKE_STORE_PUT_RESERVATION_BYTES": ("put_reservation_bytes", "a byte count"),
    "MOONCAKE_STORE_RPC_BUSY_POLL_US": ("rpc_busy_poll_us", "a whole number of microseconds"),
}


ENV_BOOL = {
    "MOONCAKE_STORE_TUNE_MALLOC": "tune_malloc",
    "MOONCAKE_STORE_NO_UVLOOP": "no_uvloop",
}
ENV_FIELDS = frozenset(
    [*ENV_STR.values(), *(f for f, _ in ENV_INT.values()), *ENV_BOOL.values(), "test_pause"]
)


def env_value(field: str):
    """The one variable of ``field`` (a key of :func:`env_defaults`), parsed; None when unset.

    Raises ``ValueError`` for that variable only (a malformed other one is not read).
    """
    return env_defaults(ENV_FIELDS - {field}).get(field)


def env_defaults(given: frozenset = frozenset()) -> dict:
    """The store's ``MOONCAKE_*`` environment variables, parsed (absent ones omitted).

    given: fields set explicitly, whose variables are neither read nor checked (an explicit
    argument wins, also over a malformed variable). Raises ``ValueError`` for a malformed
    value, naming the variable.
    """
    env = os.environ
    out: dict = {}
    for var, field in ENV_STR.items():
        if env.get(var) and field not in given:
            out[field] = env[var]
    for var, (field, what) in ENV_INT.items():
        if env.get(var) and field not in given:
            if not (env[var].isascii() and env[var].isdigit()):
                raise ValueError(f"{var} must be {what}, got {env[var]!r}")
            out[field] = int(env[var])
    for var, field in ENV_BOOL.items():
        if env.get(var) and field not in given:
            if env[var] not in ("0", "1"):
                raise ValueError(f"{var} must be 0 or 1, got {env[var]!r}")
            out[field] = env[var] == "1"
    if env.get("MOONCAKE_STORE_TEST_PAUSE") and "test_pause" not in given:
        v = env["MOONCAKE_STORE_TEST_PAUSE"]
        what, _, secs = v.partition(":")
        try:
            out["test_pause"] = (what, float(secs))
        except ValueError:
            raise ValueError(
                f"MOONCAKE_STORE_TEST_PAUSE must be put:SECONDS or get:SECONDS, got {v!r}"
            ) from None
        if what not in ("put", "get"):
            raise ValueError(
                f"MOONCAKE_STORE_TEST_PAUSE must be put:SECONDS or get:SECONDS, got {v!r}"
            )
    return out
