"""The SSD tier: one file per object in a client's directory.

File layout: ``MAGIC`` (8 bytes), header length (4 bytes, big-endian), a msgpack header
``{"k": key, "v": version, "s": size, "m": meta, "c": crc32 of the data}`` (plus ``"x"``:
the object's links, ``{"p": parent, "t": [tags], "g": group}``, where it has any), then
the data.
Files are written to a temporary name, flushed and renamed, so a crash leaves either the
whole file or none. At start a client scans its directory and registers every valid file
again, which is how SSD entries survive a full restart of master and clients.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
import struct
import zlib

import msgpack

from ..common.errors import StoreError, TransferError

MAGIC = b"MCSTSSD1"
_HLEN = struct.Struct(">I")
MAX_HEADER = 1 << 16


def path_for(root: str, key: str, version: int) -> str:
    """The path of ``key``'s file at ``version``: ``root/h[:2]/h-version.obj``.

    ``h`` is the hex SHA-256 of the key.
    """
    h = hashlib.sha256(key.encode()).hexdigest()
    return os.path.join(root, h[:2], f"{h}-{version}.obj")


def lock_dir(root: str) -> int:
    """Creates ``root`` if needed and takes its lock (``root/.lock``, ``flock``).

    One client per directory, since each registers every file it finds there as its own. Returns the
    lock's descriptor (closing it releases the lock). Raises ``StoreError`` when another live
    process holds it, ``ValueError`` when ``root`` is not a directory.
    """
    try:
        os.makedirs(root, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"StoreConfig: ssd_dir {root!r} is not a directory") from None
    if not os.path.isdir(root):
        raise ValueError(f"StoreConfig: ssd_dir {root!r} is not a directory")
    fd = os.open(os.path.join(root, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        finally:
            os.close(fd)
        raise StoreError(
            f"ssd_dir {root!r} is in use by another store client (pid {holder or '?'}); "
            "give each client its own directory"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _open_regular(path: str):
    """Opens ``path`` for reading if it is a regular file (a FIFO there blocked forever).

    ``ValueError`` otherwise.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _syncfs(root: str) -> bool:
    """Flushes the file system that holds ``root`` (Linux ``syncfs``); False where unavailable."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL(None, use_errno=True)
            _LIBC.syncfs  # noqa: B018 (absent outside Linux: AttributeError)
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC is False:
        return False
    fd = os.open(root, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _LIBC.syncfs(fd) != 0:
            import ctypes

            raise OSError(ctypes.get_errno(), "syncfs failed")
    finally:
        os.close(fd)
    return True


_LIBC = None


def write_many(root: str, objs: list) -> list:
    """Writes several object files with one flush of the disk; per object its path or an error.

    Each file is written under a temporary name, then one ``syncfs`` makes them all durable,
    then each is renamed: a crash still leaves either a whole file or none, and a burst of
    evictions costs one flush instead of one ``fsync`` per file (3-6 ms each for 8 KiB files
    on the 2-core CI VM, which held offloads to a few hundred per second).

    Args:
        root: the SSD directory.
        objs: ``(key, version, meta, data, links)`` per object, as for :func:`write`.
    """
    out: list = []
    tmps = []
    for key, version, meta, data, links in objs:
        path = path_for(root, key, version)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_head(key, version, meta, data, links))
                f.write(data)
            out.append(path)
            tmps.append((len(out) - 1, tmp, path))
        except OSError as e:
            out.append(e)
    if tmps:
        try:
            if not _syncfs(root):
                for _i, tmp, _path in tmps:
                    fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
        except OSError as e:
            for i, tmp, _path in tmps:
                out[i] = e
                _unlink_quietly(tmp)
            return out
        for i, tmp, path in tmps:
            try:
                os.replace(tmp, path)
            except OSError as e:
                out[i] = e
                _unlink_quietly(tmp)
    return out


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:  # already gone, or the disk failed: the file is not registered either way
        pass


def _head(key: str, version: int, meta: bytes, data, links: dict | None) -> bytes:
    head = {"k": key, "v": version, "s": len(data), "m": meta, "c": zlib.crc32(data)}
    if links:
        head["x"] = links
    header = msgpack.packb(head, use_bin_type=True)
    return MAGIC + _HLEN.pack(len(header)) + header


def write(
    root: str, key: str, version: int, meta: bytes, data: memoryview, links: dict | None = None
) -> str:
    """Writes one object file; returns its path. Raises ``OSError``.

    Args:
        root: the SSD directory.
        key: the object's key.
        version: the object's version.
        meta: the object's metadata bytes.
        data: the object's bytes.
        links: the object's parent, tags and group as the master sends them with an
            offload (``{"p", "t", "g"}``), kept in the header for a restart.
    """
    path = path_for(root, key, version)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(_head(key, version, meta, data, links))
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _read_header(f):
    head = f.read(len(MAGIC) + 4)
    if len(head) != len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
        raise ValueError("not a store SSD file")
    (n,) = _HLEN.unpack(head[len(MAGIC) :])
    if n > MAX_HEADER:
        raise ValueError("header too large")
    h = msgpack.unpackb(f.read(n), raw=False)
    if not (
        isinstance(h, dict)
        and isinstance(h.get("k"), str)
        and isinstance(h.get("v"), int)
        and isinstance(h.get("s"), int)
        and isinstance(h.get("m"), bytes)
        and isinstance(h.get("c"), int)
    ):
        raise ValueError("bad header")
    return h


class CorruptError(TransferError):
    """The SSD file is gone or does not hold what it should: the replica is useless and is dropped.

    It holds another key or version, has the wrong size, is truncated, or fails its checksum.
    """


def read_into(path: str, key: str, version: int, out: memoryview | bytearray) -> int:
    """Reads the object's data into the writable buffer ``out`` (exactly its size).

    Checks key, version and checksum. Raises ``CorruptError`` when the file is missing or its
    contents are wrong, ``TransferError`` for other I/O errors.
    """
    try:
        with _open_regular(path) as f:
            h = _read_header(f)
            if h["k"] != key or h["v"] != version:
                raise ValueError(f"file holds {h['k']!r} version {h['v']}")
            if os.fstat(f.fileno()).st_size != f.tell() + h["s"]:  # as scan() checks at start
                raise ValueError("file length does not match its header")
            mv = memoryview(out).cast("B")
            if len(mv) != h["s"]:
                raise ValueError("size mismatch")
            got = f.readinto(mv)
            if got != h["s"]:
                raise ValueError("file is truncated")
            if zlib.crc32(mv) != h["c"]:
                raise ValueError("checksum mismatch")
            return got
    except (
        FileNotFoundError,
        ValueError,
        msgpack.exceptions.ExtraData,
        msgpack.exceptions.UnpackException,
    ) as e:
        raise CorruptError(f"SSD replica of {key!r} at {path} is corrupt: {e}") from None
    except OSError as e:
        raise TransferError(f"SSD replica of {key!r} at {path} unreadable: {e}") from None


def scan(root: str) -> list:
    """``[key, version, size, meta, path]`` for every valid file under ``root``.

    The links its header keeps are appended where it has some; temporary files of
    interrupted writes are removed.
    """
    out = []
    if not os.path.isdir(root):
        return out
    for sub in sorted(os.listdir(root)):
        d = os.path.join(root, sub)
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            p = os.path.join(d, name)
            if ".tmp" in name:
                try:
                    os.unlink(p)
                except OSError:
                    pass
                continue
            if not name.endswith(".obj"):
                continue
            try:
                with _open_regular(p) as f:
                    h = _read_header(f)
                    if os.fstat(f.fileno()).st_size != f.tell() + h["s"]:
                        continue
                e = [h["k"], h["v"], h["s"], h["m"], p]
                if isinstance(h.get("x"), dict):
                    e.append(h["x"])
                out.append(e)
            except (
                OSError,
                ValueError,
                msgpack.exceptions.ExtraData,
                msgpack.exceptions.UnpackException,
            ):
                continue
    return out


def delete(path: str) -> None:
    """Deletes the file at ``path``; a file already gone (or any ``OSError``) is ignored."""
    try:
        os.unlink(path)
    except OSError:
        pass
