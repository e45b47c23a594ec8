"""Store throughput and latency: ``mooncake_store`` against Redis and the published Mooncake store.

For each system, object size (4 KiB, 1 MiB, 16 MiB, 64 MiB), call form (``plain``: one
key per call; ``batch``: at most 128 keys and at most 16 MiB per call), number of client
processes (1 and 2, running at the same time) and set-up, each client puts its objects,
then gets them back, and the bench reports throughput (GiB/s and objects/s over all
clients) and per-call latency (p50, p99). Every case runs ``--reps`` times; the medians
are reported and compared with the peers measured in the same run. The systems run side
by side and take turns case by case (repetition ``r`` starts with system ``r mod n``), so
that other load on the machine hits all of them alike; the load average is printed.

Set-ups (docs/design.md "Benchmarks"); every system runs in its best documented
configuration:

* ``host``: one host. Each client process contributes its own segment and prefers it for
  its puts (ours: a shared memory segment, ``ReplicateConfig(preferred_segment=name)``;
  Mooncake: its ``global_segment_size``, ``ReplicateConfig.preferred_segment`` = the
  client's ``get_hostname()``, since Mooncake's master otherwise places each object on a
  random segment, the storage process's included); Redis: a ``redis-server`` on 127.0.0.1.
* ``tcp``: a separate storage process owns the segment; clients contribute none and reach
  it over TCP (ours: the C++ transfer engine, the storage process counting as another
  host; Mooncake: protocol ``tcp``). Redis has no such set-up (it is TCP already).

Reads land in a buffer each client allocated once (ours: ``get_into``/``get_into_batch``;
Mooncake: ``get_into``/``batch_get_into`` into a buffer registered with
``register_buffer``, and puts with ``put_from``/``batch_put_from`` from a registered
buffer, the zero-copy path its docs advise); Redis returns new ``bytes`` (redis-py has no
other form).

Peers: Redis (Debian ``redis-server``; ``MOONCAKE_TEST_REDIS=HOST:PORT`` or a server this
bench starts on a free port) through ``redis-py`` (SET/GET; MSET/MGET for batches), and
the published Mooncake store (``pip install mooncake-transfer-engine-non-cuda`` + Debian
``libibverbs1 librdmacm1``) through the calls named above, run
inside ``unshare -n`` (a network namespace with only loopback, since its clients listen
on every interface; every system then runs inside that namespace, Redis included) with
``mooncake_master --rpc_address=127.0.0.1`` and clients on ``P2PHANDSHAKE``, protocol
``tcp``. Systems that are not installed are skipped (said so).
Both masters run as their own process with a 1 s read lease (``--lease-ttl 1``,
``--default_kv_lease_ttl=1000``), so the space of each case's objects (removed after the
case, outside the timed part) comes back before the next case.
One torch thread per process; values are fixed random bytes.

Metadata load (``--meta``, ours against Mooncake's master; the smoke runs one client of it
after its other cases): each of 1, 2, 4 and 8 client processes puts 1024 values of 16 KiB
(16 keys per call; Mooncake ``batch_put_from``), then makes 512 lookups of 128 keys each
(``exists_batch``; Mooncake ``batch_is_exist``), then removes its keys one per call
(``remove``; Mooncake ``remove``, after the 1 s lease, outside the timing). All clients start
each phase together; calls/s over all clients and p50/p99 per call, medians over ``--reps``.
Mooncake's master runs with its defaults (16 RPC threads, TCP_NODELAY).

    .venv/bin/python benchmarks/store_bench.py                  # full run (minutes)
    .venv/bin/python benchmarks/store_bench.py --meta           # metadata load only
    .venv/bin/python benchmarks/store_bench.py --smoke          # CI: small, checks it works
    .venv/bin/python benchmarks/store_bench.py --json out.json --markdown table.md

Gates (printed, and ``--gate`` makes a failed one exit 1): batch put/get of 1-64 MiB at
least 0.9x Mooncake on one host and at least 1x over TCP; batch 4 KiB at least 0.5x
Mooncake's objects/s (one host and over TCP); at least 5x Redis at 1 MiB and above (one
host); metadata load at least 1x Mooncake's calls/s with p99 at most 1.5x its p99, per
op and client count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, MiB, 16 * MiB, 64 * MiB]
BATCH_KEYS, BATCH_BYTES = 128, 16 * MiB
RECV_BYTES = max(BATCH_BYTES, max(SIZES))  # what one call reads at most
# --meta: metadata load. Lookups of 128 keys per call (a 64K-token prompt's chunks), puts of
# 16 KiB values (16 keys per call), removes of one key per call (Mooncake's remove takes one).
META_SIZE, META_PUT_KEYS, META_LOOKUP_KEYS = 16 * KiB, 16, 128
META_BUF = META_SIZE * META_PUT_KEYS
META_SEGMENT = 64 * MiB
META_OPS = ("put", "lookup", "remove")


def size_name(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def objects_per_client(size: int, smoke: bool) -> int:
    """Objects each client puts and gets per case."""
    if size <= 4 * KiB:
        return 256 if smoke else 2048
    total = (32 if smoke else 256) * MiB
    return max(1, min(256, total // size))


def batches(keys: list, size: int, mode: str) -> list:
    if mode == "plain":
        return [[k] for k in keys]
    per = max(1, min(BATCH_KEYS, BATCH_BYTES // size))
    return [keys[i : i + per] for i in range(0, len(keys), per)]


# =============================================================================== workers
class OurClient:
    def __init__(self, spec):
        from mooncake_store import MooncakeStore, ReplicateConfig

        if spec["setup"] == "host":
            self.s = MooncakeStore(
                master=spec["master"],
                segment_size=spec["segment"],
                serve_tcp=False,
                name=spec["name"],
            )
            self.rc = ReplicateConfig(preferred_segment=spec["name"])
        else:
            self.s = MooncakeStore(
                master=spec["master"],
                segment_size=0,
                transfer="tcp",
                serve_tcp=False,
                host_id=f"client-{spec['name']}",
                name=spec["name"],
            )
            self.rc = ReplicateConfig()
        # reads land here (get_into), as Mooncake's do
        self.recv = bytearray(META_BUF if spec.get("meta") else RECV_BYTES)

    def exists(self, keys):
        return [bool(x) for x in self.s.exists_batch(keys)]

    def remove_one(self, key):
        self.s.remove(key)
        return True

    def put(self, keys, vals):
        if len(keys) == 1:
            self.s.put(keys[0], vals[0], self.rc)
        else:
            self.s.put_batch(keys, vals, self.rc)

    def get(self, keys, size):
        views = _recv_views(self.recv, len(keys), size)
        if len(keys) == 1:
            self.s.get_into(keys[0], views[0])
        else:
            self.s.get_into_batch(keys, views)
        return views

    def remove(self, keys):
        self.s.remove_batch(keys, force=True, return_exceptions=True)

    def close(self):
        self.s.close()


class RedisClient:
    def __init__(self, spec):
        import redis

        host, port = spec["redis"].rsplit(":", 1)
        self.r = redis.Redis(host=host, port=int(port))

    def put(self, keys, vals):
        if len(keys) == 1:
            self.r.set(keys[0], vals[0])
        else:
            self.r.mset(dict(zip(keys, vals)))

    def get(self, keys, size):
        if len(keys) == 1:
            return [self.r.get(keys[0])]
        return self.r.mget(keys)

    def remove(self, keys):
        self.r.delete(*keys)

    def close(self):
        self.r.close()


class MooncakeClient:
    """The published Mooncake store in its documented fast configuration: each client's
    own segment preferred for its puts on one host (``ReplicateConfig.preferred_segment``
    = the client's segment name; the master's default placement is random over every
    segment, the storage process's included), and zero-copy transfers from and into
    buffers registered with ``register_buffer`` (``put_from``/``batch_put_from``,
    ``get_into``/``batch_get_into``)."""

    def __init__(self, spec):
        import ctypes

        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.s = MooncakeDistributedStore()
        seg = spec["segment"] if spec["setup"] == "host" else 0
        rc = self.s.setup("127.0.0.1", "P2PHANDSHAKE", seg, 256 * MiB, "tcp", "", spec["master"])
        if rc != 0:
            raise RuntimeError(f"mooncake setup failed: {rc}")
        self.rc = ReplicateConfig()
        if spec["setup"] == "host":
            self.rc.preferred_segment = self.s.get_hostname()
        meta = spec.get("meta")
        self.recv = bytearray(META_BUF if meta else RECV_BYTES)
        self.send = bytearray(META_BUF if meta else max(SIZES))
        self._ptr = {}
        for name in ("recv", "send"):
            buf = getattr(self, name)
            self._ptr[name] = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
            if self.s.register_buffer(self._ptr[name], len(buf)) != 0:
                raise RuntimeError(f"mooncake register_buffer({name}) failed")
        self._sent = None

    def put(self, keys, vals):
        size = len(vals[0])
        if self._sent is not vals[0]:  # every key of a case has the same value
            self.send[:size] = vals[0]
            self._sent = vals[0]
        ptr = self._ptr["send"]
        if len(keys) == 1:
            rc = self.s.put_from(keys[0], ptr, size, self.rc)
            bad = rc != 0
        else:
            rcs = self.s.batch_put_from(keys, [ptr] * len(keys), [size] * len(keys), self.rc)
            bad = any(r != 0 for r in rcs)
        if bad:
            raise RuntimeError("mooncake put failed")

    def get(self, keys, size):
        views = _recv_views(self.recv, len(keys), size)
        base = self._ptr["recv"]
        ptrs = [base + i * size for i in range(len(keys))]
        if len(keys) == 1:
            got = [self.s.get_into(keys[0], ptrs[0], size)]
        else:
            got = self.s.batch_get_into(keys, ptrs, [size] * len(keys))
        return [v if n == size else None for v, n in zip(views, got)]

    def remove(self, keys):
        time.sleep(1.05)  # a leased object cannot be removed (1 s lease)
        for k in keys:
            self.s.remove(k)

    def exists(self, keys):
        return [x == 1 for x in self.s.batch_is_exist(keys)]

    def remove_one(self, key):
        return self.s.remove(key) == 0

    def close(self):
        self.s.close()


def _recv_views(buf: bytearray, n: int, size: int) -> list:
    """``n`` consecutive ``size``-byte windows of ``buf``: where one call's values land."""
    mv = memoryview(buf)
    return [mv[i * size : (i + 1) * size] for i in range(n)]


CLIENTS = {"ours": OurClient, "redis": RedisClient, "mooncake": MooncakeClient}


def worker_main(spec: dict):
    """Runs the cases it is told on stdin (one JSON line each, after which it waits for
    'go'); answers one JSON line per case."""
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    client = CLIENTS[spec["system"]](spec)
    values = {}
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        case = json.loads(line)
        if case.get("exit"):
            break
        if case.get("meta"):
            meta_case(client, spec, case, out)
            continue
        size, mode, n = case["size"], case["mode"], case["n"]
        if size not in values:
            values[size] = os.urandom(size)
        v = values[size]
        keys = [f"{spec['name']}-{case['tag']}-{i}" for i in range(n)]
        groups = batches(keys, size, mode)
        out.write(json.dumps({"armed": True}) + "\n")
        out.flush()
        sys.stdin.readline()  # "go"
        lat_put, lat_get = [], []
        t0 = time.perf_counter()
        for g in groups:
            a = time.perf_counter()
            client.put(g, [v] * len(g))
            lat_put.append(time.perf_counter() - a)
        t1 = time.perf_counter()
        out.write(json.dumps({"phase": "put", "start": t0 + 0.0, "end": t1}) + "\n")
        out.flush()
        sys.stdin.readline()  # "go" for the get phase
        t2 = time.perf_counter()
        ok = True
        for g in groups:
            a = time.perf_counter()
            got = client.get(g, size)
            lat_get.append(time.perf_counter() - a)
            ok = ok and len(got) == len(g) and all(x is not None and len(x) == size for x in got)
        t3 = time.perf_counter()
        if case.get("check"):
            ok = ok and bytes(client.get(groups[0], size)[0]) == v
        client.remove(keys)
        out.write(
            json.dumps(
                {
                    "phase": "done",
                    "put": [t0, t1, lat_put],
                    "get": [t2, t3, lat_get],
                    "ok": ok,
                    "wall_put": time.time(),
                }
            )
            + "\n"
        )
        out.flush()
    client.close()


def meta_case(client, spec: dict, case: dict, out):
    """One repetition of the metadata load: puts, lookups, removes, each phase started by a
    'go' on stdin so that every client runs the same phase at the same time."""
    n, calls = case["n"], case["lookups"]
    v = os.urandom(META_SIZE)
    keys = [f"{spec['name']}-m{case['tag']}-{i}" for i in range(n)]
    puts = [keys[i : i + META_PUT_KEYS] for i in range(0, n, META_PUT_KEYS)]
    windows = [keys[i : i + META_LOOKUP_KEYS] for i in range(0, n, META_LOOKUP_KEYS)]
    out.write(json.dumps({"armed": True}) + "\n")
    out.flush()
    res, ok = {}, True
    for op in META_OPS:
        sys.stdin.readline()  # "go"
        lat = []
        t0 = time.perf_counter()
        if op == "put":
            for g in puts:
                a = time.perf_counter()
                client.put(g, [v] * len(g))
                lat.append(time.perf_counter() - a)
        elif op == "lookup":
            for j in range(calls):
                a = time.perf_counter()
                got = client.exists(windows[j % len(windows)])
                lat.append(time.perf_counter() - a)
                ok = ok and all(got)
        else:
            for k in keys:
                a = time.perf_counter()
                ok = client.remove_one(k) and ok
                lat.append(time.perf_counter() - a)
        t1 = time.perf_counter()
        res[op] = [t0, t1, lat]
        if op == "lookup":
            time.sleep(1.05)  # outside the timing: a leased object cannot be removed (1 s lease)
        out.write(json.dumps({"phase": op}) + "\n")
        out.flush()
    ok = ok and not any(client.exists(keys[:META_LOOKUP_KEYS]))
    out.write(json.dumps(dict(res, phase="done", ok=ok)) + "\n")
    out.flush()


# =============================================================================== per system
class Procs:
    def __init__(self):
        self.ps = []

    def spawn(self, args, **kw):
        p = subprocess.Popen(args, start_new_session=True, **kw)
        self.ps.append(p)
        return p

    def kill_all(self):
        for p in self.ps:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.ps = []


def percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[k]


class WorkerGroup:
    """The client processes of one system for one set-up and client count."""

    def __init__(self, system, setup, clients, base_spec, procs: Procs, log):
        self.system, self.setup, self.clients = system, setup, clients
        env = dict(_env(), OMP_NUM_THREADS="1")
        self.workers = []
        for c in range(clients):
            spec = dict(
                base_spec, system=system, setup=setup, name=f"{system}-{setup}-c{c}-{os.getpid()}"
            )
            p = procs.spawn(
                [sys.executable, __file__, "--role", "worker", "--spec", json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                text=True,
                bufsize=1,
            )
            self.workers.append(p)
        for p in self.workers:
            self.read(p)  # ready

    def read(self, p):
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.system} worker exited (see the log)")
        return json.loads(line)

    def tell(self, obj):
        for p in self.workers:
            p.stdin.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
            p.stdin.flush()

    def run(self, size, mode, n, tag, check) -> dict:
        """One repetition of one case on every client at once: {op: (seconds, objects, latencies)}."""
        self.tell({"size": size, "mode": mode, "n": n, "tag": tag, "check": check})
        for p in self.workers:
            self.read(p)  # armed
        self.tell("go")
        for p in self.workers:
            self.read(p)  # put phase done
        self.tell("go")
        res = [self.read(p) for p in self.workers]
        if not all(r["ok"] for r in res):
            raise RuntimeError(
                f"{self.system} {self.setup} {size_name(size)} {mode}: wrong data read back"
            )
        out = {}
        for op in ("put", "get"):
            out[op] = (
                max(r[op][1] for r in res) - min(r[op][0] for r in res),
                n * self.clients,
                [x for r in res for x in r[op][2]],
            )
        return out

    def run_meta(self, n, lookups, tag) -> dict:
        """One repetition of the metadata load on every client at once:
        {op: (seconds, calls, latencies per call)}."""
        self.tell({"meta": True, "n": n, "lookups": lookups, "tag": tag})
        for p in self.workers:
            self.read(p)  # armed
        for _ in META_OPS:
            self.tell("go")
            for p in self.workers:
                self.read(p)  # phase done
        res = [self.read(p) for p in self.workers]
        if not all(r["ok"] for r in res):
            raise RuntimeError(f"{self.system} meta: a lookup or remove went wrong")
        return {
            op: (
                max(r[op][1] for r in res) - min(r[op][0] for r in res),
                sum(len(r[op][2]) for r in res),
                [x for r in res for x in r[op][2]],
            )
            for op in META_OPS
        }

    def close(self):
        try:
            self.tell({"exit": True})
        except OSError:
            return
        for p in self.workers:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass


def run_interleaved(groups: list, args) -> list:
    """Runs every case on every group, alternating between the systems repetition by
    repetition (rotating who goes first), so that a change of load on the machine hits
    all systems alike. Returns one record per (group, size, form, op) with medians."""
    records = []
    tag = 0
    for size in args.sizes:
        for mode in ("plain", "batch"):
            n = objects_per_client(size, args.smoke)
            reps = {id(g): {"put": [], "get": []} for g in groups}
            for rep in range(args.reps):
                k = rep % len(groups)
                for g in groups[k:] + groups[:k]:
                    tag += 1
                    res = g.run(size, mode, n, tag, rep == 0)
                    for op in ("put", "get"):
                        reps[id(g)][op].append(res[op])
                # removed objects' space comes back after the 1 s lease of both masters
                if any(g.system in ("ours", "mooncake") for g in groups):
                    time.sleep(1.1)
            for g in groups:
                for op in ("put", "get"):
                    rs = reps[id(g)][op]
                    thr = [objs * size / secs / (1 << 30) for secs, objs, _ in rs]
                    ops = [objs / secs for secs, objs, _ in rs]
                    lats = [x for _, _, ls in rs for x in ls]
                    rec = {
                        "system": g.system,
                        "setup": g.setup,
                        "clients": g.clients,
                        "size": size,
                        "mode": mode,
                        "op": op,
                        "gib_s": statistics.median(thr),
                        "objs_s": statistics.median(ops),
                        "p50_ms": percentile(lats, 0.5) * 1e3,
                        "p99_ms": percentile(lats, 0.99) * 1e3,
                        "reps": len(rs),
                    }
                    records.append(rec)
                    print(
                        f"  {g.system:8s} {g.setup:4s} c={g.clients} {size_name(size):>6s} {mode:5s} {op}: "
                        f"{rec['gib_s']:7.2f} GiB/s {rec['objs_s']:10.0f} obj/s p50 {rec['p50_ms']:8.3f} ms "
                        f"p99 {rec['p99_ms']:8.3f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
    return records


def meta_sizes(smoke: bool) -> tuple:
    """(keys each client puts and removes, lookup calls each client makes) per repetition."""
    return (128, 32) if smoke else (1024, 512)


def run_meta_interleaved(groups: list, args, tag: int = 10**6) -> list:
    """The metadata load on every group, systems taking turns repetition by repetition as in
    :func:`run_interleaved`. One record per (group, op): medians over repetitions of calls/s
    and keys/s, and p50/p99 of the per-call latency over all repetitions."""
    n, lookups = meta_sizes(args.smoke)
    per_call = {"put": META_PUT_KEYS, "lookup": META_LOOKUP_KEYS, "remove": 1}
    reps = {id(g): {op: [] for op in META_OPS} for g in groups}
    for rep in range(args.reps):
        k = rep % len(groups)
        for g in groups[k:] + groups[:k]:
            tag += 1
            res = g.run_meta(n, lookups, tag)
            for op in META_OPS:
                reps[id(g)][op].append(res[op])
        time.sleep(1.1)  # removed objects' space comes back after the 1 s lease
    records = []
    for g in groups:
        for op in META_OPS:
            rs = reps[id(g)][op]
            lats = [x for _, _, ls in rs for x in ls]
            calls_s = statistics.median(c / secs for secs, c, _ in rs)
            rec = {
                "system": g.system,
                "setup": "meta",
                "clients": g.clients,
                "size": META_SIZE,
                "mode": "meta",
                "op": op,
                "keys_per_call": per_call[op],
                "calls_s": calls_s,
                "objs_s": calls_s * per_call[op],
                "p50_ms": percentile(lats, 0.5) * 1e3,
                "p99_ms": percentile(lats, 0.99) * 1e3,
                "reps": len(rs),
            }
            records.append(rec)
            print(
                f"  {g.system:8s} meta c={g.clients} {op:6s} ({per_call[op]:3d} keys/call): "
                f"{calls_s:9.0f} calls/s {rec['objs_s']:10.0f} keys/s p50 {rec['p50_ms']:8.3f} ms "
                f"p99 {rec['p99_ms']:8.3f} ms",
                file=sys.stderr,
                flush=True,
            )
    return records


def _env():
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def start_services(systems, args, procs: Procs, log, seg) -> dict:
    """Starts each system's master (or server) and the TCP-hop storage process; returns
    the base worker spec per (system, set-up)."""
    bases = {}
    if "ours" in systems:
        d = tempfile.mkdtemp(prefix="store-bench-")
        pf = os.path.join(d, "port")
        procs.spawn(
            [
                sys.executable,
                "-m",
                "mooncake_store.master",
                "--port",
                "0",
                "--port-file",
                pf,
                "--lease-ttl",
                "1",
            ],
            stdout=log,
            stderr=log,
            env=_env(),
        )
        deadline = time.monotonic() + 30
        while not os.path.exists(pf):
            if time.monotonic() > deadline:
                raise RuntimeError("our master did not start")
            time.sleep(0.05)
        master = f"127.0.0.1:{open(pf).read().split()[0]}"
        storage = procs.spawn(
            [
                sys.executable,
                "-c",
                (
                    "import signal; from mooncake_store import MooncakeStore;"
                    f"s=MooncakeStore(master={master!r}, segment_size={seg * 2}, host_id='storage-host', name='storage');"
                    "print('ready', flush=True); signal.pause()"
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=_env(),
        )
        if storage.stdout.readline().strip() != "ready":
            raise RuntimeError("our storage process did not start")
        bases[("ours", "host")] = bases[("ours", "tcp")] = {"master": master, "segment": seg}
    if "redis" in systems:
        endpoint = None if args.in_netns else os.environ.get("MOONCAKE_TEST_REDIS")
        if not endpoint:
            port = free_port()
            procs.spawn(
                [
                    "redis-server",
                    "--bind",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ],
                stdout=log,
                stderr=log,
            )
            endpoint = f"127.0.0.1:{port}"
            import redis

            deadline = time.monotonic() + 10
            while True:
                try:
                    redis.Redis(host="127.0.0.1", port=port).ping()
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        bases[("redis", "host")] = {"redis": endpoint}
    if "mooncake" in systems:
        port = free_port()
        master_bin = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
        procs.spawn(
            [
                master_bin,
                "--rpc_address=127.0.0.1",
                f"--port={port}",
                "--default_kv_lease_ttl=1000",
            ],
            stdout=log,
            stderr=log,
        )
        time.sleep(1.5)
        storage = procs.spawn(
            [
                sys.executable,
                "-c",
                (
                    "import signal; from mooncake.store import MooncakeDistributedStore as M; s=M();"
                    f"rc=s.setup('127.0.0.1','P2PHANDSHAKE',{seg * 2},{16 * MiB},'tcp','','127.0.0.1:{port}');"
                    "print('ready' if rc == 0 else 'failed', flush=True); signal.pause()"
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        if storage.stdout.readline().strip() != "ready":
            raise RuntimeError("mooncake storage process did not start")
        bases[("mooncake", "host")] = bases[("mooncake", "tcp")] = {
            "master": f"127.0.0.1:{port}",
            "segment": seg,
        }
    return bases


def suite_main(args):
    """Runs every case of every system (interleaved) and prints the records as one JSON line."""
    procs = Procs()
    log = open(os.path.join(args.logdir, "systems.log"), "a")
    seg = (
        META_SEGMENT
        if args.meta_only
        else max(args.sizes) * 2 + (64 * MiB if args.smoke else 512 * MiB)
    )
    systems = args.systems.split(",")
    records = []
    try:
        bases = start_services(systems, args, procs, log, seg)
        for setup in ("host", "tcp") if not args.meta_only else ():
            for clients in args.clients:
                groups = []
                try:
                    for system in systems:
                        if (system, setup) in bases:
                            groups.append(
                                WorkerGroup(
                                    system, setup, clients, bases[(system, setup)], procs, log
                                )
                            )
                    records += run_interleaved(groups, args)
                finally:
                    for g in groups:
                        g.close()
        for clients in args.meta_clients:
            groups = []
            try:
                for system in systems:
                    if system in ("ours", "mooncake") and (system, "host") in bases:
                        spec = dict(bases[(system, "host")], meta=True, segment=META_SEGMENT)
                        groups.append(WorkerGroup(system, "host", clients, spec, procs, log))
                records += run_meta_interleaved(groups, args)
            finally:
                for g in groups:
                    g.close()
    finally:
        procs.kill_all()
    print(json.dumps(records), flush=True)


# =============================================================================== driver
def available(system: str) -> tuple[bool, str]:
    if system == "ours":
        return True, ""
    if system == "redis":
        try:
            import redis  # noqa: F401
        except ImportError:
            return False, "redis-py is not installed"
        if not os.environ.get("MOONCAKE_TEST_REDIS") and shutil.which("redis-server") is None:
            return (
                False,
                "no redis-server (apt-get install redis-server) and MOONCAKE_TEST_REDIS unset",
            )
        return True, ""
    if system == "mooncake":
        try:
            import importlib.util

            if importlib.util.find_spec("mooncake.store") is None:
                raise ImportError
        except ImportError:
            return (
                False,
                "the published Mooncake store is not installed (pip install mooncake-transfer-engine-non-cuda)",
            )
        if shutil.which("unshare") is None or shutil.which("ip") is None:
            return False, "needs unshare and ip (util-linux, iproute2) for its network namespace"
        r = subprocess.run(["unshare", "-n", "true"], capture_output=True)
        if r.returncode != 0:
            return False, "cannot create a network namespace (unshare -n needs root)"
        return True, ""
    return False, "unknown system"


def run_suite(systems: list, args) -> list:
    cmd = [
        sys.executable,
        __file__,
        "--role",
        "suite",
        "--systems",
        ",".join(systems),
        "--logdir",
        args.logdir,
        "--reps",
        str(args.reps),
        "--sizes",
        ",".join(map(str, args.sizes)),
        "--clients",
        ",".join(map(str, args.clients)),
        "--meta-clients",
        ",".join(map(str, args.meta_clients)),
    ]
    cmd += (["--smoke"] if args.smoke else []) + (["--meta-only"] if args.meta_only else [])
    if "mooncake" in systems:  # every system in one network namespace that has only loopback
        cmd = (
            ["unshare", "-n", "sh", "-c", "ip link set lo up && exec \"$@\"", "sh"]
            + cmd
            + ["--in-netns"]
        )
    r = subprocess.run(
        cmd, stdout=subprocess.PIPE, text=True, timeout=args.timeout, start_new_session=True
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("[")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"the benchmark failed (exit {r.returncode}); logs in {args.logdir}")
    return json.loads(lines[-1])


def find(records, **kw):
    for r in records:
        if all(r[k] == v for k, v in kw.items()):
            return r
    return None


def copy_ceiling(sizes: list, reps: int = 7) -> dict:
    """GiB/s of one single-threaded copy per size, medians: ``warm`` into memory touched
    before (what a put into a prefaulted segment can reach at best), ``fresh`` into a new
    ``bytes`` object (what a get that returns new ``bytes`` can reach at best: allocation
    and first-touch page faults included). Any store that copies a value once is bounded
    by these."""
    import numpy as np

    out = {}
    for size in sizes:
        src = np.frombuffer(os.urandom(size), dtype=np.uint8)
        dst = np.empty_like(src)
        dst[:] = 1
        warm, fresh = [], []
        for _ in range(reps):
            t = time.perf_counter()
            np.copyto(dst, src)
            warm.append(time.perf_counter() - t)
            t = time.perf_counter()
            b = bytes(memoryview(src))
            fresh.append(time.perf_counter() - t)
            del b
        out[size] = {
            "warm": size / statistics.median(warm) / 2**30,
            "fresh": size / statistics.median(fresh) / 2**30,
        }
    return out


def cold_copy_us(idle_s: float = 2.0, pieces: int = 32) -> float:
    """Median microseconds of one 1 MiB copy into memory nobody touched for ``idle_s``
    seconds. On VMs such memory costs extra at its next access (the CI VM: ~0.5 us per
    4 KiB page in calm phases, several us in busy ones, against ~60 us for the whole copy
    into memory in use); measured at the start and the end of a run, it says how much of
    that the run met."""
    import numpy as np

    src = np.frombuffer(os.urandom(MiB), dtype=np.uint8)
    dst = np.ones(pieces * MiB, dtype=np.uint8)
    time.sleep(idle_s)
    took = []
    for i in range(pieces):
        t = time.perf_counter()
        np.copyto(dst[i * MiB : (i + 1) * MiB], src)
        took.append(time.perf_counter() - t)
    return statistics.median(took) * 1e6


_ECHO = """
import socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    b = c.recv(64)
    if not b:
        break
    c.sendall(b)
"""


def loopback_rtt(n: int = 2000) -> float:
    """Median seconds of a 64-byte TCP ping-pong with another process on 127.0.0.1: the
    floor of one metadata round trip to a master on this machine."""
    p = subprocess.Popen(
        [sys.executable, "-c", _ECHO], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        port = int(p.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            msg, times = b"x" * 64, []
            for _ in range(n):
                t = time.perf_counter()
                c.sendall(msg)
                got = 0
                while got < len(msg):
                    got += len(c.recv(64))
                times.append(time.perf_counter() - t)
        return statistics.median(times)
    finally:
        p.kill()
        p.wait()


def gates(records, args) -> list:
    """[(name, ok or None when a peer is missing, detail)] for the gates of docs/design.md "Benchmarks"."""
    out = []
    big = [s for s in args.sizes if s >= MiB]
    for op in ("put", "get"):
        for setup, need in (("host", 0.9), ("tcp", 1.0)):
            for size in big:
                o = find(
                    records, system="ours", setup=setup, clients=1, size=size, mode="batch", op=op
                )
                m = find(
                    records,
                    system="mooncake",
                    setup=setup,
                    clients=1,
                    size=size,
                    mode="batch",
                    op=op,
                )
                if o and m:
                    ratio = o["gib_s"] / m["gib_s"]
                    out.append(
                        (
                            f"batch {op} {size_name(size)} {setup} >= {need}x Mooncake",
                            ratio >= need,
                            f"{ratio:.2f}x ({o['gib_s']:.2f} vs {m['gib_s']:.2f} GiB/s)",
                        )
                    )
        for setup in ("host", "tcp") if 4 * KiB in args.sizes else ():
            o = find(
                records, system="ours", setup=setup, clients=1, size=4 * KiB, mode="batch", op=op
            )
            m = find(
                records,
                system="mooncake",
                setup=setup,
                clients=1,
                size=4 * KiB,
                mode="batch",
                op=op,
            )
            if o and m:
                ratio = o["objs_s"] / m["objs_s"]
                out.append(
                    (
                        f"batch {op} 4 KiB {setup} >= 0.5x Mooncake objects/s",
                        ratio >= 0.5,
                        f"{ratio:.2f}x ({o['objs_s']:.0f} vs {m['objs_s']:.0f} obj/s)",
                    )
                )
        for size in big:
            for mode in ("plain", "batch"):
                o = find(
                    records, system="ours", setup="host", clients=1, size=size, mode=mode, op=op
                )
                r = find(
                    records, system="redis", setup="host", clients=1, size=size, mode=mode, op=op
                )
                if o and r:
                    ratio = o["gib_s"] / r["gib_s"]
                    detail = f"{ratio:.2f}x ({o['gib_s']:.2f} vs {r['gib_s']:.2f} GiB/s)"
                    if ratio < 5.0:
                        detail += f"; 5x Redis = {5 * r['gib_s']:.2f} GiB/s"
                    out.append(
                        (f"{mode} {op} {size_name(size)} host >= 5x Redis", ratio >= 5.0, detail)
                    )
    return out


def meta_gates(records, args) -> list:
    """Metadata load: ours at least 1x Mooncake's calls/s and p99 at most 1.5x, per op and
    client count."""
    out = []
    for clients in args.meta_clients:
        for op in META_OPS:
            o = find(records, system="ours", setup="meta", clients=clients, op=op)
            m = find(records, system="mooncake", setup="meta", clients=clients, op=op)
            if o and m:
                ratio, p99 = o["calls_s"] / m["calls_s"], o["p99_ms"] / m["p99_ms"]
                out.append(
                    (
                        f"meta {op} c={clients} >= 1x Mooncake calls/s, p99 <= 1.5x",
                        ratio >= 1.0 and p99 <= 1.5,
                        f"{ratio:.2f}x ({o['calls_s']:.0f} vs {m['calls_s']:.0f} calls/s), "
                        f"p99 {p99:.2f}x ({o['p99_ms']:.2f} vs {m['p99_ms']:.2f} ms)",
                    )
                )
    return out


def meta_markdown(records, args) -> str:
    """The metadata load's table: per client count and op, both systems and their ratio."""
    lines = [
        "| clients | op | keys/call | ours calls/s | Mooncake calls/s | ratio | "
        "ours p50/p99 ms | Mooncake p50/p99 ms | p99 ours/Mooncake |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for clients in args.meta_clients:
        for op in META_OPS:
            o = find(records, system="ours", setup="meta", clients=clients, op=op)
            m = find(records, system="mooncake", setup="meta", clients=clients, op=op)
            if o is None:
                continue
            cells = [f"{r['p50_ms']:.2f}/{r['p99_ms']:.2f}" if r else "-" for r in (o, m)]
            ratio = f"{o['calls_s'] / m['calls_s']:.2f}x" if m else "-"
            p99 = f"{o['p99_ms'] / m['p99_ms']:.2f}x" if m else "-"
            theirs = f"{m['calls_s']:.0f}" if m else "-"
            lines.append(
                f"| {clients} | {op} | {o['keys_per_call']} | {o['calls_s']:.0f} | {theirs} | "
                f"{ratio} | {cells[0]} | {cells[1]} | {p99} |"
            )
    return "\n".join(lines) + "\n"


def markdown(records, args) -> str:
    systems = [s for s in ("ours", "mooncake", "redis") if any(r["system"] == s for r in records)]
    lines = [
        "| set-up | clients | size | form | op | "
        + " | ".join(f"{s} GiB/s (obj/s) p50/p99 ms" for s in systems)
        + " | ours / Mooncake | ours / Redis |",
        "|" + "---|" * (7 + len(systems)),
    ]
    for setup in ("host", "tcp"):
        for clients in args.clients:
            for size in args.sizes:
                for mode in ("plain", "batch"):
                    for op in ("put", "get"):
                        cells, row = [], {}
                        for s in systems:
                            r = find(
                                records,
                                system=s,
                                setup=setup,
                                clients=clients,
                                size=size,
                                mode=mode,
                                op=op,
                            )
                            row[s] = r
                            cells.append(
                                "-"
                                if r is None
                                else f"{r['gib_s']:.2f} ({r['objs_s']:.0f}) {r['p50_ms']:.2f}/{r['p99_ms']:.2f}"
                            )
                        if row.get("ours") is None:
                            continue
                        key = "objs_s" if size < MiB else "gib_s"
                        rm = (
                            f"{row['ours'][key] / row['mooncake'][key]:.2f}x"
                            if row.get("mooncake")
                            else "-"
                        )
                        rr = (
                            f"{row['ours'][key] / row['redis'][key]:.2f}x"
                            if row.get("redis")
                            else "-"
                        )
                        lines.append(
                            f"| {setup} | {clients} | {size_name(size)} | {mode} | {op} | "
                            + " | ".join(cells)
                            + f" | {rm} | {rr} |"
                        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", default="driver", choices=["driver", "suite", "worker"])
    p.add_argument("--spec", default=None)
    p.add_argument("--smoke", action="store_true", help="small and fast (CI)")
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help="repetitions per case (median reported); default 3, smoke 1",
    )
    p.add_argument("--sizes", default=None, help="comma-separated object sizes in bytes")
    p.add_argument("--clients", default=None, help="client counts (default 1,2; smoke 1)")
    p.add_argument("--systems", default="ours,mooncake,redis")
    p.add_argument("--json", default=None, help="write every record here")
    p.add_argument("--markdown", default=None, help="write the README table here")
    p.add_argument("--gate", action="store_true", help="exit 1 when a gate fails")
    p.add_argument("--logdir", default=None)
    p.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the whole run")
    p.add_argument(
        "--meta",
        action="store_true",
        help="only the metadata load (lookups, small puts, removes; ours and Mooncake)",
    )
    p.add_argument(
        "--meta-clients",
        default=None,
        help="client counts of the metadata load (default 1,2,4,8; smoke 1)",
    )
    p.add_argument("--meta-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "worker":
        worker_main(json.loads(args.spec))
        return 0
    args.reps = args.reps or (1 if args.smoke else 3)
    args.sizes = (
        [int(x) for x in args.sizes.split(",")]
        if args.sizes
        else ([4 * KiB, MiB] if args.smoke else SIZES)
    )
    args.clients = [int(x) for x in (args.clients or ("1" if args.smoke else "1,2")).split(",")]
    if args.role == "driver":
        args.meta_only = args.meta
        if args.meta_clients is None:  # the smoke always includes a small metadata run
            args.meta_clients = "1" if args.smoke else ("1,2,4,8" if args.meta else "")
    args.meta_clients = [int(x) for x in (args.meta_clients or "").split(",") if x]
    if args.role == "suite":
        suite_main(args)
        return 0
    args.logdir = args.logdir or tempfile.mkdtemp(prefix="store-bench-logs-")
    systems, skipped = [], {}
    if args.meta_only:  # the metadata load compares with Mooncake's master only
        args.systems = ",".join(x for x in args.systems.split(",") if x != "redis")
    for system in args.systems.split(","):
        ok, why = available(system)
        if ok:
            systems.append(system)
        else:
            skipped[system] = why
            print(f"[store_bench] skipping {system}: {why}", file=sys.stderr)
    if "mooncake" in systems and "redis" in systems and shutil.which("redis-server") is None:
        systems.remove("redis")
        skipped["redis"] = "no redis-server binary to start inside the network namespace"
    print(
        f"[store_bench] systems (interleaved case by case): {', '.join(systems)}; load average "
        f"{os.getloadavg()[0]:.1f}",
        file=sys.stderr,
        flush=True,
    )
    ceiling: dict = copy_ceiling([x for x in args.sizes if x >= MiB and not args.meta_only])
    ceiling["rtt_s"] = loopback_rtt()
    cold = [cold_copy_us(0.5 if args.smoke else 2.0)]
    records = run_suite(systems, args)
    cold.append(cold_copy_us(0.5 if args.smoke else 2.0))
    table = markdown(records, args) if not args.meta_only else ""
    if args.meta_clients:
        table += meta_markdown(records, args)
    table += (
        f"\nFloors measured in the same run: a 64-byte TCP ping-pong between two processes on "
        f"127.0.0.1 takes {ceiling['rtt_s'] * 1e6:.0f} us (median)"
        + ("; one single-threaded copy, GiB/s: " if len(ceiling) > 1 else "")
        + "; ".join(
            f"{size_name(k)} {v['warm']:.2f} into touched memory, {v['fresh']:.2f} into new bytes"
            for k, v in ceiling.items()
            if k != "rtt_s"
        )
        + f"; a 1 MiB copy into memory idle for {0.5 if args.smoke else 2.0:g} s took {cold[0]:.0f} us at the "
        f"start and {cold[1]:.0f} us at the end of the run (median)\n"
    )
    print(table)
    results = gates(records, args) + meta_gates(records, args)
    failed = [g for g in results if g[1] is False]
    for name, ok, detail in results:
        print(f"gate {'PASS' if ok else 'FAIL'}: {name}: {detail}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "records": records,
                    "skipped": skipped,
                    "gates": results,
                    "smoke": args.smoke,
                    "copy_ceiling_gib_s": {str(k): v for k, v in ceiling.items()},
                    "cold_copy_1mib_us": {"start": cold[0], "end": cold[1]},
                    "reps": args.reps,
                },
                f,
                indent=1,
            )
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    print(
        f"[store_bench] {len(records)} records, {len(failed)} gate(s) failed, load average at the end "
        f"{os.getloadavg()[0]:.1f}, logs in {args.logdir}",
        file=sys.stderr,
    )
    return 1 if (args.gate and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
