"""A pool of long-lived ``torch.distributed`` rank processes for the tests.

Importing torch costs seconds per process, so multi-rank tests reuse rank processes::

    pool = get_pool(4, "mooncake", transport="shm")
    results = pool.run(fn, *args, timeout=60)     # fn(rank, world_size, *args) on every rank

``fn`` must be a module-level function (it is looked up by module and name in the ranks);
the process group is already initialised there (``dist.init_process_group`` with
``file://`` rendezvous in a private temporary directory; never a fixed port) and
``torch.set_num_threads(1)`` is in effect. ``results[r]`` is rank ``r``'s return value
(tensors are fine). If any rank raises, :class:`RankError` is raised with every rank's
exception (type name, message, traceback) in ``err.errors``; with
``return_exceptions=True`` the :class:`RemoteError` objects come back in place of results.

Safety:

* every rank runs in its own process session (``os.setsid``); tearing a pool down kills
  each rank's process group (``os.killpg``), and so does interpreter exit (``atexit``)
  and the death of the test process (``PR_SET_PDEATHSIG``);
* every call has a timeout: a rank that does not answer in time makes the call raise
  :class:`RankTimeout` (with the Python stacks of the hung ranks), and the pool is torn
  down; the next :func:`get_pool` creates a fresh one;
* after a call in which some rank raised, the pool is health-checked (all_reduce +
  barrier) before it is handed out again, and recreated if the check fails.

Start-up: by default rank processes are forked from a "zygote" process that has already
imported torch (and ``mooncake_pg`` when it is importable), so a pool starts in well under
a second. ``MOONCAKE_TEST_POOL_MODE=spawn`` starts every rank as a fresh interpreter
instead. Pools are cached per (world size, backend, transport, op timeout); at most
``MOONCAKE_TEST_MAX_POOLS`` (default 6) live at once, least recently used first out.

Backends: ``"mooncake"`` (``pg_options=MooncakeOptions(timeout=..., transport=...)``),
``"gloo"``, or any other registered name. Rank logs live in the session's temporary
directory (``MOONCAKE_TEST_KEEP_LOGS=1`` keeps it after exit); the tail of a rank's log
is attached to errors about that rank.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import importlib
import importlib.util
import io
import itertools
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as _mp_wait

from tests import REPO_ROOT
from tests.faults import alive, kill_group

DEFAULT_OP_TIMEOUT = float(os.environ.get("MOONCAKE_TEST_OP_TIMEOUT", "30"))
START_TIMEOUT = float(os.environ.get("MOONCAKE_TEST_START_TIMEOUT", "120"))
MAX_POOLS = int(os.environ.get("MOONCAKE_TEST_MAX_POOLS", "6"))
# After one rank raised, how long the others get to answer before the pool is killed.
ERROR_GRACE = float(os.environ.get("MOONCAKE_TEST_ERROR_GRACE", "10"))

# Modules the zygote imports before forking ranks (each one optional).
_PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.nn.parallel",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "torch.testing",
]

_PR_SET_PDEATHSIG = 1


def _dumps(obj) -> bytes:
    # Not multiprocessing's ForkingPickler: torch.multiprocessing's reducers would share
    # tensor storages through file descriptors. Not plain pickle either: in torch 2.13 a
    # plainly pickled float8/uint16/uint32/uint64 tensor does not unpickle. torch.save
    # handles every dtype (and any other picklable object).
    torch = sys.modules.get("torch")
    if torch is None:
        return b"P" + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buf = io.BytesIO()
    torch.save(obj, buf)
    return b"T" + buf.getvalue()


def _loads(data: bytes):
    if data[:1] == b"P":
        return pickle.loads(data[1:])
    import torch

    return torch.load(io.BytesIO(data[1:]), weights_only=False)


def _set_pdeathsig():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # pragma: no cover - non-Linux
        pass


def _log_tail(path, limit=4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


# ----------------------------------------------------------------------------- errors


class RemoteError:
    """An exception raised inside a rank, as data (type name, message, traceback)."""

    def __init__(self, rank, type_name, qualname, message, tb="", log=""):
        self.rank = rank
        self.type_name = type_name  # e.g. "ValueError"
        self.qualname = qualname  # e.g. "builtins.ValueError"
        self.message = message  # str(exc)
        self.traceback = tb
        self.mro = []  # names of the exception's base classes
        self.log = log

    @classmethod
    def from_exc(cls, exc, rank):
        t = type(exc)
        err = cls(
            rank,
            t.__name__,
            f"{t.__module__}.{t.__qualname__}",
            str(exc),
            "".join(traceback.format_exception(t, exc, exc.__traceback__)),
        )
        err.mro = [c.__name__ for c in t.__mro__]
        return err

    def isinstance_of(self, name: str) -> bool:
        """True if the remote exception's class or one of its bases is called ``name``."""
        return name == self.type_name or name in self.mro

    def __repr__(self):
        return f"RemoteError(rank={self.rank}, {self.type_name}: {self.message!r})"

    def __str__(self):
        return f"rank {self.rank}: {self.type_name}: {self.message}"


class RankError(RuntimeError):
    """Some ranks raised (``errors``: rank -> RemoteError); ``results`` holds the others."""

    def __init__(self, summary, errors=None, results=None):
        self.errors = dict(errors or {})
        self.results = results
        parts = [summary]
        for r in sorted(self.errors):
            e = self.errors[r]
            parts.append(f"--- rank {r}: {e.type_name}: {e.message}")
            if e.traceback:
                parts.append(e.traceback.rstrip())
            if e.log:
                parts.append(f"--- rank {r} log tail:\n{e.log.rstrip()}")
        super().__init__("\n".join(parts))


class RankTimeout(RankError):
    """Some ranks did not answer within the call's timeout; the pool was torn down."""


class PoolStartError(RankError):
    """The pool's ranks could not be started or could not initialise the process group."""


# ------------------------------------------------------------------- rank-side code


def _resolve_function(module_name, file, qualname):
    mod = sys.modules.get(module_name)
    if mod is None or module_name == "__main__":
        mod = None
        if module_name != "__main__":
            try:
                mod = importlib.import_module(module_name)
            except ImportError:
                mod = None
        if mod is None:
            if not file:
                raise ImportError(f"cannot import {module_name} in the rank process")
            name = (
                module_name
                if module_name != "__main__"
                else "_rankpool_main_" + str(abs(hash(file)))
            )
            mod = sys.modules.get(name)
            if mod is None:
                spec = importlib.util.spec_from_file_location(name, file)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[name] = mod
                spec.loader.exec_module(mod)
    obj = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _init_process_group(spec):
    from datetime import timedelta

    import torch.distributed as dist

    backend = spec["backend"]
    kwargs = dict(
        backend=backend,
        init_method="file://" + spec["store_file"],
        rank=spec["rank"],
        world_size=spec["world_size"],
    )
    if backend == "mooncake":
        import mooncake_pg

        opts = {"timeout": spec["op_timeout"]}
        if spec.get("transport"):
            opts["transport"] = spec["transport"]
        opts.update(spec.get("options") or {})
        kwargs["pg_options"] = mooncake_pg.MooncakeOptions(**opts)
        kwargs["timeout"] = timedelta(seconds=max(60.0, spec["op_timeout"]))
    else:
        kwargs["timeout"] = timedelta(seconds=spec["op_timeout"])
    dist.init_process_group(**kwargs)


def _worker_main(spec):
    """Body of one rank process (forked from the zygote or started fresh)."""
    os.environ.update(spec.get("env") or {})
    import faulthandler

    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)

    rank, ws = spec["rank"], spec["world_size"]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(spec["sock"])
    conn = Connection(sock.detach())
    conn.send_bytes(_dumps(("hello", spec["pool_id"], rank, os.getpid(), spec["token"])))

    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    import torch.distributed as dist

    try:
        _init_process_group(spec)
        conn.send_bytes(_dumps(("ready", 0, None)))
    except BaseException as e:
        conn.send_bytes(_dumps(("err", 0, RemoteError.from_exc(e, rank))))
        sys.stderr.flush()
        os._exit(3)

    while True:
        try:
            msg = _loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        kind = msg[0]
        if kind == "call":
            _, call_id, mod, file, qualname, args, kwargs = msg
            try:
                fn = _resolve_function(mod, file, qualname)
                res = fn(rank, ws, *args, **kwargs)
                payload = _dumps(("ok", call_id, res))
            except BaseException as e:
                payload = _dumps(("err", call_id, RemoteError.from_exc(e, rank)))
            conn.send_bytes(payload)
        elif kind == "exit":
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            except BaseException:
                traceback.print_exc()
            try:
                conn.send_bytes(_dumps(("bye", 0, None)))
            except OSError:
                pass
            break
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _redirect_output(log_path):
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _child_entry(spec, parent_pid):
    """Common start of a rank: own session, die with the parent, output to a log."""
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader (spawn mode uses start_new_session)
    _set_pdeathsig()
    if os.getppid() != parent_pid:  # parent died before prctl took effect
        os._exit(1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _redirect_output(spec["log"])
    try:
        _worker_main(spec)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _zygote_main(sock_path, token):
    """Imports torch once, then forks one rank process per request from the parent."""
    _set_pdeathsig()
    os.getppid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    preload = list(_PRELOAD)
    if os.environ.get("MOONCAKE_TEST_ZYGOTE_PRELOAD_MOONCAKE", "1") != "0":
        preload.append("mooncake_pg")
    failed = {}
    for name in preload:
        try:
            importlib.import_module(name)
        except BaseException as e:
            failed[name] = f"{type(e).__name__}: {e}"
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sock_path)
    conn = Connection(sock.detach())
    conn.send_bytes(_dumps(("zygote", os.getpid(), token, threads, failed)))
    while True:
        try:
            msg = _loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if msg[0] == "spawn":
            spec = msg[1]
            pid = os.fork()
            if pid == 0:
                try:
                    conn.close()
                except OSError:
                    pass
                _child_entry(spec, _zygote_pid)
            conn.send_bytes(_dumps(("spawned", pid)))
        elif msg[0] == "exit":
            break
    os._exit(0)


_zygote_pid = None


def _main(argv):
    global _zygote_pid
    if argv[0] == "--zygote":
        _zygote_pid = os.getpid()
        _zygote_main(argv[1], argv[2])
    elif argv[0] == "--rank":
        spec = json.loads(argv[1])
        _child_entry(spec, int(argv[2]))
    else:
        raise SystemExit(f"rankpool: unknown mode {argv[0]!r}")


# ----------------------------------------------------------------- parent-side code


def _remove_stale_tmpdirs():
    """Removes the temporary directories of earlier sessions whose process died without
    cleaning up (SIGKILL); their rank processes died with them (PR_SET_PDEATHSIG)."""
    if os.environ.get("MOONCAKE_TEST_KEEP_LOGS", "0") not in ("", "0"):
        return
    base = tempfile.gettempdir()
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        if not name.startswith("mooncake-tests-"):
            continue
        path = os.path.join(base, name)
        try:
            with open(os.path.join(path, "owner.pid")) as f:
                pid = int(f.read().strip())
            if os.stat(path).st_uid != os.getuid():
                continue
        except (OSError, ValueError):
            continue
        if alive(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)


class _Session:
    """Per-process state: temporary directory, control socket, zygote."""

    def __init__(self):
        _remove_stale_tmpdirs()
        self.tmpdir = tempfile.mkdtemp(prefix="mooncake-tests-")
        os.chmod(self.tmpdir, 0o700)
        with open(os.path.join(self.tmpdir, "owner.pid"), "w") as f:
            f.write(str(os.getpid()))
        self.sock_path = os.path.join(self.tmpdir, "ctl.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.sock_path)
        self.listener.listen(64)
        self.token = os.urandom(8).hex()
        self.mode = os.environ.get("MOONCAKE_TEST_POOL_MODE", "fork")
        self.zygote = None  # subprocess.Popen
        self.zconn = None
        self.zygote_info = None
        self.spawned = []  # Popen objects (spawn mode), reaped on close

    # -- connections
    def accept(self, deadline):
        """Next incoming connection and its hello message, or None at the deadline."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.listener.settimeout(remaining)
            try:
                s, _ = self.listener.accept()
            except TimeoutError:
                return None
            s.settimeout(None)
            conn = Connection(s.detach())
            if not conn.poll(max(0.1, min(10.0, deadline - time.monotonic()))):
                conn.close()
                continue
            try:
                hello = _loads(conn.recv_bytes())
            except Exception:
                conn.close()
                continue
            return conn, hello

    def _python_cmd(self, *args):
        # the repository root is on sys.path: the working directory and PYTHONPATH
        code = "import sys; from tests import rankpool; rankpool._main(sys.argv[1:])"
        return [sys.executable, "-c", code, *args]

    def _child_env(self):
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("MKL_NUM_THREADS", "1")
        pp = env.get("PYTHONPATH", "")
        # test functions are looked up by module name (``tests.pg.test_ft``) in the ranks
        env["PYTHONPATH"] = os.pathsep.join([p for p in (REPO_ROOT, pp) if p])
        return env

    def _ensure_zygote(self):
        if self.zconn is not None and self.zygote is not None and self.zygote.poll() is None:
            return True
        self._close_zygote()
        log = open(os.path.join(self.tmpdir, "zygote.log"), "ab")
        self.zygote = subprocess.Popen(
            self._python_cmd("--zygote", self.sock_path, self.token),
            cwd=REPO_ROOT,
            env=self._child_env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            got = self.accept(deadline)
            if got is None:
                self._close_zygote()
                return False
            conn, hello = got
            if hello[0] == "zygote" and hello[2] == self.token:
                break
            conn.close()
        self.zconn = conn
        self.zygote_info = {"pid": hello[1], "threads": hello[3], "preload_failed": hello[4]}
        if hello[3] > 1:
            # Forking a multi-threaded process is not safe: fall back to fresh processes.
            sys.stderr.write(
                f"rankpool: zygote has {hello[3]} threads after imports; using spawn mode\n"
            )
            self._close_zygote()
            self.mode = "spawn"
            return False
        return True

    def _close_zygote(self):
        if self.zconn is not None:
            try:
                self.zconn.close()
            except OSError:
                pass
            self.zconn = None
        if self.zygote is not None:
            kill_group(self.zygote.pid)
            try:
                self.zygote.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self.zygote = None

    def spawn(self, spec):
        """Start one rank process; returns its pid (= its process group id)."""
        if self.mode == "fork" and self._ensure_zygote():
            try:
                self.zconn.send_bytes(_dumps(("spawn", spec)))
                if self.zconn.poll(30):
                    msg = _loads(self.zconn.recv_bytes())
                    if msg[0] == "spawned":
                        return msg[1]
            except (EOFError, OSError):
                pass
            self._close_zygote()
            raise PoolStartError("rankpool: the zygote did not fork a rank process")
        with open(spec["log"], "ab") as log:
            p = subprocess.Popen(
                self._python_cmd("--rank", json.dumps(spec), str(os.getpid())),
                cwd=REPO_ROOT,
                env=self._child_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.spawned.append(p)
        return p.pid

    def reap(self):
        running = []
        for p in self.spawned:
            if p.poll() is None:
                running.append(p)
        self.spawned = running

    def close(self):
        self._close_zygote()
        for p in self.spawned:
            kill_group(p.pid)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.spawned = []
        try:
            self.listener.close()
        except OSError:
            pass
        if os.environ.get("MOONCAKE_TEST_KEEP_LOGS", "0") in ("", "0"):
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        else:
            sys.stderr.write(f"rankpool: logs kept in {self.tmpdir}\n")


_session: _Session | None = None
_pools: collections.OrderedDict[tuple, RankPool] = collections.OrderedDict()
_pool_ids = itertools.count(1)


def _get_session() -> _Session:
    global _session
    if _session is None:
        _session = _Session()
    return _session


def _health_check(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if t.item() != world_size * (world_size + 1) / 2:
        raise RuntimeError(f"health check: all_reduce gave {t.item()}")
    dist.barrier()
    return True


class RankPool:
    """``world_size`` rank processes with an initialised default process group."""

    def __init__(
        self,
        world_size,
        backend,
        transport=None,
        op_timeout=None,
        options=None,
        env=None,
        rank_options=None,
    ):
        self.world_size = int(world_size)
        self.backend = backend
        self.transport = transport
        self.op_timeout = float(op_timeout if op_timeout is not None else DEFAULT_OP_TIMEOUT)
        self.options = dict(options or {})
        self.rank_options = {int(r): dict(o) for r, o in (rank_options or {}).items()}
        self.env = dict(env or {})
        self.id = next(_pool_ids)
        self.pids = []
        self.conns = []
        self.logs = []
        self.alive = False
        self.dirty = False
        self._calls = itertools.count(1)
        self._start()

    def __repr__(self):
        return (
            f"RankPool(id={self.id}, world_size={self.world_size}, backend={self.backend!r}, "
            f"transport={self.transport!r}, op_timeout={self.op_timeout})"
        )

    # -- life cycle
    def _start(self):
        s = _get_session()
        store_file = os.path.join(s.tmpdir, f"pool{self.id}.store")
        env = {
            "GLOO_SOCKET_IFNAME": "lo",
            "MOONCAKE_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        env.update(self.env)
        for k in ("GLOO_SOCKET_IFNAME", "MOONCAKE_SOCKET_IFNAME"):
            if k in os.environ and k not in self.env:
                env[k] = os.environ[k]
        t0 = time.monotonic()
        try:
            for rank in range(self.world_size):
                log = os.path.join(s.tmpdir, f"pool{self.id}-rank{rank}.log")
                self.logs.append(log)
                spec = {
                    "sock": s.sock_path,
                    "token": s.token,
                    "pool_id": self.id,
                    "rank": rank,
                    "world_size": self.world_size,
                    "backend": self.backend,
                    "transport": self.transport,
                    "op_timeout": self.op_timeout,
                    "options": {**self.options, **self.rank_options.get(rank, {})},
                    "store_file": store_file,
                    "log": log,
                    "env": env,
                }
                self.pids.append(s.spawn(spec))
            self.alive = True
            deadline = t0 + START_TIMEOUT
            conns = {}
            while len(conns) < self.world_size:
                got = s.accept(deadline)
                if got is None:
                    missing = sorted(set(range(self.world_size)) - set(conns))
                    raise PoolStartError(
                        f"{self!r}: ranks {missing} did not connect within {START_TIMEOUT:.0f} s",
                        {
                            r: RemoteError(
                                r,
                                "StartTimeout",
                                "",
                                "did not connect",
                                log=_log_tail(self.logs[r]),
                            )
                            for r in missing
                        },
                    )
                conn, hello = got
                if hello[0] != "hello" or hello[1] != self.id or hello[4] != s.token:
                    conn.close()  # a straggler of an older pool
                    continue
                conns[hello[2]] = conn
                self.pids[hello[2]] = hello[3]
            self.conns = [conns[r] for r in range(self.world_size)]
            self._collect(0, deadline, what="init_process_group", start=True)
        except BaseException:
            self.close(graceful=False)
            raise
        self.start_seconds = time.monotonic() - t0

    def close(self, graceful=True):
        """Stops the ranks (``destroy_process_group`` first when ``graceful``), then kills
        every rank's process group."""
        if graceful and self.alive and self.conns:
            try:
                for c in self.conns:
                    c.send_bytes(_dumps(("exit",)))
                deadline = time.monotonic() + 5
                pending = list(self.conns)
                while pending and time.monotonic() < deadline:
                    ready = _mp_wait(pending, timeout=max(0.0, deadline - time.monotonic()))
                    for c in ready:
                        try:
                            c.recv_bytes()
                        except (EOFError, OSError):
                            pass
                        pending.remove(c)
            except (OSError, EOFError):
                pass
        for pid in self.pids:
            kill_group(pid)
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass
        self.conns = []
        self.alive = False
        for key, p in list(_pools.items()):
            if p is self:
                del _pools[key]
        if _session is not None:
            _session.reap()

    # -- calls
    def _dump_stacks(self, ranks):
        for r in ranks:
            try:
                os.kill(self.pids[r], signal.SIGUSR1)
            except (ProcessLookupError, PermissionError, IndexError):
                pass
        time.sleep(1.0)

    def _collect(self, call_id, deadline, what, start=False, return_exceptions=False):
        results = [None] * self.world_size
        errors = {}
        pending = set(range(self.world_size))
        err_deadline = None
        while pending:
            limit = deadline if err_deadline is None else min(deadline, err_deadline)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            by_conn = {self.conns[r]: r for r in pending}
            for c in _mp_wait(list(by_conn), timeout=remaining):
                r = by_conn[c]
                try:
                    msg = _loads(c.recv_bytes())
                except (EOFError, OSError):
                    errors[r] = RemoteError(
                        r, "RankDied", "", "the rank process exited", log=_log_tail(self.logs[r])
                    )
                    pending.discard(r)
                    self.dirty = True
                    continue
                if msg[1] != call_id:
                    continue  # the answer to an older, abandoned call
                if msg[0] == "ok" or msg[0] == "ready":
                    results[r] = msg[2]
                else:
                    errors[r] = msg[2]
                    if start:
                        errors[r].log = _log_tail(self.logs[r])
                    if err_deadline is None:
                        err_deadline = time.monotonic() + ERROR_GRACE
                pending.discard(r)
        if pending:
            self._dump_stacks(sorted(pending))
            for r in sorted(pending):
                errors[r] = RemoteError(
                    r, "Timeout", "", f"no answer to {what}", log=_log_tail(self.logs[r], 8000)
                )
            self.close(graceful=False)
            cls = PoolStartError if start else RankTimeout
            raise cls(
                f"{self!r}: ranks {sorted(pending)} did not finish {what} in time (pool torn down)",
                errors,
                results,
            )
        if errors:
            if start:
                raise PoolStartError(f"{self!r}: {what} failed", errors, results)
            self.dirty = True
            if return_exceptions:
                return [errors.get(r, results[r]) for r in range(self.world_size)]
            names = ", ".join(f"{r}:{errors[r].type_name}" for r in sorted(errors))
            raise RankError(f"{self!r}: {what} raised on ranks [{names}]", errors, results)
        return results

    def run(self, fn, *args, timeout=60.0, return_exceptions=False, **kwargs):
        """Runs ``fn(rank, world_size, *args, **kwargs)`` on every rank; returns the list
        of per-rank results. Raises :class:`RankError` if any rank raised (or, with
        ``return_exceptions``, returns :class:`RemoteError` objects in their place) and
        :class:`RankTimeout` if some rank did not answer within ``timeout`` seconds."""
        if not self.alive:
            raise RuntimeError(f"{self!r} is closed")
        mod = fn.__module__
        file = getattr(sys.modules.get(mod), "__file__", None)
        call_id = next(self._calls)
        what = f"{mod}.{fn.__qualname__}"
        blob = _dumps(("call", call_id, mod, file, fn.__qualname__, args, kwargs))
        deadline = time.monotonic() + timeout
        finished = False
        try:
            for c in self.conns:
                c.send_bytes(blob)
            out = self._collect(call_id, deadline, what, return_exceptions=return_exceptions)
            finished = True
            return out
        except RankError:
            finished = True
            raise
        finally:
            if not finished:  # interrupted (pytest-timeout, Ctrl-C, broken pipe): start over
                self.close(graceful=False)

    def healthy(self, timeout=20.0) -> bool:
        try:
            self.run(_health_check, timeout=timeout)
        except RankError:
            return False
        self.dirty = False
        return True


def get_pool(
    world_size, backend=None, transport=None, timeout=None, options=None, env=None
) -> RankPool:
    """The cached pool for this configuration (created on first use).

    ``timeout`` is the op timeout given to the process group (MooncakeOptions.timeout for
    mooncake, init_process_group's timeout for gloo). ``options`` are further
    MooncakeOptions fields; ``env`` extra environment variables for the ranks.
    """
    backend = backend or default_backend()[0]
    if backend == "mooncake" and transport is None:
        transport = default_backend()[1] if default_backend()[0] == "mooncake" else None
    if backend != "mooncake":
        transport = None
    op_timeout = float(timeout if timeout is not None else DEFAULT_OP_TIMEOUT)
    key = (
        int(world_size),
        backend,
        transport,
        op_timeout,
        tuple(sorted((options or {}).items())),
        tuple(sorted((env or {}).items())),
    )
    pool = _pools.get(key)
    if pool is not None:
        _pools.move_to_end(key)
        if pool.alive and (not pool.dirty or pool.healthy()):
            return pool
        pool.close(graceful=False)
    while len(_pools) >= max(1, MAX_POOLS):
        _, old = _pools.popitem(last=False)
        old.close()
    pool = RankPool(world_size, backend, transport, op_timeout, options, env)
    _pools[key] = pool
    return pool


def shutdown_all():
    """Closes every pool and the session (zygote, socket, temporary directory)."""
    global _session
    for pool in list(_pools.values()):
        try:
            pool.close()
        except Exception:
            pool.close(graceful=False)
    _pools.clear()
    if _session is not None:
        _session.close()
        _session = None


atexit.register(shutdown_all)


# ------------------------------------------------------------- backend selection


def parse_backends(value=None):
    """``MOONCAKE_TEST_BACKENDS``: comma-separated ``backend[:transport]`` items.

    Default ``"mooncake,mooncake:tcp"``: the conformance suite runs over the default
    transport (``auto``: shared memory on one host) and over forced TCP; the other test
    files use the first entry. ``"gloo"`` develops the tests without the extension.
    """
    if value is None:
        value = os.environ.get("MOONCAKE_TEST_BACKENDS", "mooncake,mooncake:tcp")
    out = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, transport = item.partition(":")
        out.append((name, transport or None))
    return out or [("mooncake", None)]


def default_backend():
    """The first ``(backend, transport)`` of ``MOONCAKE_TEST_BACKENDS``."""
    return parse_backends()[0]


def backend_id(bt) -> str:
    name, transport = bt
    return f"{name}-{transport}" if transport else name
