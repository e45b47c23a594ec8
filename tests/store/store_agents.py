"""Real processes for the store tests: a master and client "agents".

``start_master(**flags)`` runs ``python -m mooncake_store.master`` (own session, port 0,
127.0.0.1) and returns a :class:`Proc` with ``.address``; ``start_agent(config)`` runs
this module (``python -m tests.store.store_agents``) as a client process that obeys JSON-line commands on stdin (one reply line
per command on stdout). Values are generated on both sides from ``(seed, size)``
(``pattern``), so large objects never travel through the pipe; agents answer with
sizes and SHA-256 digests. Every process lives in its own session; ``Proc.kill()``
SIGKILLs its process group, and ``cleanup()`` kills everything still running (the
tests call it on teardown). Every command has a timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from tests import REPO_ROOT as REPO
from tests.faults import kill_group

PY = sys.executable
_PROCS: list = []


def pattern(seed: int, size: int) -> bytes:
    """Deterministic bytes that differ per seed (and per position)."""
    import numpy as np

    if size == 0:
        return b""
    n = min(size, 1048573)  # a prime-length block, repeated: cheap for 64 MiB values
    a = (np.arange(n, dtype=np.uint64) * 2654435761 + seed * 40503 + (seed << 7)) >> 7
    block = (a % 251).astype(np.uint8).tobytes()
    return (block * (size // n + 1))[:size]


def digest(b) -> str:
    return hashlib.sha256(b).hexdigest()


class Proc:
    def __init__(self, popen: subprocess.Popen, log_path: str):
        self.p = popen
        self.log_path = log_path
        self.address = None
        self.paths = [log_path]  # removed by cleanup()
        _PROCS.append(self)

    @property
    def pid(self):
        return self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def kill(self, sig=signal.SIGKILL):
        """Signals the process group and waits up to 10 s for the process to exit."""
        kill_group(self.p, sig, wait_s=10)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""


class Agent(Proc):
    def cmd(self, op: str, timeout: float = 60, **kw):
        """Sends one command; returns its result, or raises AgentError with the remote error."""
        line = json.dumps({"op": op, **kw}) + "\n"
        self.p.stdin.write(line.encode())
        self.p.stdin.flush()
        return self.reply(timeout)

    def send(self, op: str, **kw):
        self.p.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
        self.p.stdin.flush()

    def reply(self, timeout: float = 60):
        deadline = time.monotonic() + timeout
        fd = self.p.stdout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"agent {self.pid} did not answer in {timeout} s; log:\n{self.log()}"
                )
            r, _, _ = select.select([fd], [], [], left)
            if r:
                line = fd.readline()
                if not line:
                    raise RuntimeError(f"agent {self.pid} exited; log:\n{self.log()}")
                rep = json.loads(line)
                if "err" in rep:
                    raise AgentError(rep["err"], rep["msg"])
                return rep["ok"]


class AgentError(Exception):
    def __init__(self, kind, msg):
        super().__init__(f"{kind}: {msg}")
        self.kind = kind
        self.msg = msg


def _spawn(args, env_extra=None, ns=None) -> tuple:
    """Starts ``args`` in a session of its own (inside network namespace ``ns`` if given),
    stderr to a log file; returns ``(Popen, log path)``."""
    fd, log_path = tempfile.mkstemp(prefix="mooncake-store-test-", suffix=".log")
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MOONCAKE_STORE_MASTER", None)
    env.update(env_extra or {})
    kw = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fd, env=env, cwd=REPO)
    if ns is not None:
        from tests import netns

        p = netns.run_in(ns, args, **kw)
    else:
        p = subprocess.Popen(args, start_new_session=True, **kw)
    os.close(fd)
    return p, log_path


def start_master(timeout=30, env=None, host="127.0.0.1", ns=None, **flags) -> Proc:
    """A master process listening on ``host`` (inside network namespace ``ns`` if given;
    flags: e.g. client_ttl=1.0 -> --client-ttl 1.0)."""
    d = tempfile.mkdtemp(prefix="mooncake-master-")
    port_file = os.path.join(d, "port")
    args = [
        PY,
        "-m",
        "mooncake_store.master",
        "--host",
        host,
        "--port",
        str(flags.pop("port", 0)),
        "--port-file",
        port_file,
    ]
    for k, v in flags.items():
        args += ["--" + k.replace("_", "-"), str(v)]
    p, log = _spawn(args, env, ns)
    proc = Proc(p, log)
    proc.paths.append(d)
    deadline = time.monotonic() + timeout
    # the master writes the file whole once listening; an empty one is still being written
    while not os.path.exists(port_file) or not os.path.getsize(port_file):
        if p.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"master did not start; log:\n{proc.log()}")
        time.sleep(0.02)
    with open(port_file) as f:
        port, mport = f.read().split()
    proc.address = f"{host}:{port}"
    proc.metrics_port = int(mport)
    return proc


def start_agent(config: dict, serve_tcp=False, env=None, timeout=60) -> Agent:
    """A client process holding ``MooncakeStore(**config)``; returns when it is registered."""
    p, log = _spawn([PY, "-m", "tests.store.store_agents"], env)
    a = Agent(p, log)
    a.cmd("open", config=config, serve_tcp=serve_tcp, timeout=timeout)
    return a


def cleanup():
    """Kills every process started here and removes its log and files."""
    while _PROCS:
        p = _PROCS.pop()
        p.kill()
        for path in p.paths:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.exists(path):
                os.unlink(path)


# ----------------------------------------------------------------------------- agent side
def _agent_main():
    from mooncake_store import MooncakeStore, ReplicateConfig

    store = None
    weight_syncs: dict = {}  # model name -> WeightSync (a reader keeps its version between pulls)
    out = sys.stdout

    def rc(kw):
        return ReplicateConfig(
            replica_num=kw.get("replicas", 1),
            preferred_segment=kw.get("preferred"),
            pin=kw.get("pin", False),
            require_all=kw.get("require_all", False),
        )

    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        try:
            if op == "open":
                store = MooncakeStore(serve_tcp=req.get("serve_tcp", False), **req["config"])
                res = {"name": store.name, "master": store.master_address}
            elif op == "put":
                data = pattern(req["seed"], req["size"])
                fn = store.upsert if req.get("upsert") else store.put
                res = fn(req["key"], data, rc(req))
            elif op == "put_batch":
                vals = [pattern(s, n) for s, n in zip(req["seeds"], req["sizes"])]
                res = store.put_batch(req["keys"], vals, rc(req))
            elif op == "get":
                b = store.get(req["key"])
                res = {"size": len(b), "sha": digest(b)}
            elif op == "get_batch":
                bs = store.get_batch(req["keys"], return_exceptions=True)
                res = [
                    {"err": type(b).__name__}
                    if isinstance(b, BaseException)
                    else {"size": len(b), "sha": digest(b)}
                    for b in bs
                ]
            elif op == "exists":
                res = store.exists(req["key"])
            elif op == "remove":
                store.remove(req["key"], force=req.get("force", False))
                res = None
            elif op == "iput":
                res = _iput(store, req, rc(req))
            elif op == "get_loop":
                res = _get_loop(store, req)
            elif op == "stats":
                import dataclasses

                res = dataclasses.asdict(store.stats())
            elif op in ("ws_publish", "ws_pull"):
                res = _weight_sync(store, weight_syncs, op, req)
            elif op == "close":
                store.close()
                res = None
            elif op == "exit":
                out.write(json.dumps({"ok": None}) + "\n")
                out.flush()
                os._exit(0)
            else:
                raise ValueError(f"unknown op {op}")
            out.write(json.dumps({"ok": res}) + "\n")
        except BaseException as e:
            out.write(json.dumps({"err": type(e).__name__, "msg": str(e)}) + "\n")
        out.flush()


def _iput(store, req: dict, config) -> list:
    """``store.internal.put_many`` of ``pattern(seed, size)`` values with the request's
    ``parents``, ``tags``, ``group`` and ``quota_bytes``: per key the replicas placed, or
    the error's class name."""
    vals = [pattern(s, n) for s, n in zip(req["seeds"], req["sizes"])]
    out = store.internal.put_many(
        req["keys"],
        vals,
        [b""] * len(vals),
        config,
        parents=req.get("parents"),
        tags=req.get("tags"),
        group=req.get("group"),
        quota_bytes=req.get("quota_bytes"),
        return_exceptions=True,
    )
    return [type(r).__name__ if isinstance(r, BaseException) else r for r in out]


def _get_loop(store, req: dict) -> list:
    """Gets each of ``keys`` in turn for ``seconds``: per get ``[start, key index, found,
    end]`` (``start`` and ``end``: ``time.monotonic()`` when it was called and when it
    returned, the same clock in every process of the machine)."""
    keys, out = req["keys"], []
    end = time.monotonic() + req["seconds"]
    while time.monotonic() < end:
        for i, k in enumerate(keys):
            t = time.monotonic()
            try:
                store.get(k)
                found = True
            except KeyError:
                found = False
            out.append([t, i, found, time.monotonic()])
    return out


def ws_state(version: int, tensors: int, kib: int) -> dict:
    """The state dict of a weight-sync test's ``version``: float32 tensors of ``kib`` KiB."""
    import torch

    g = torch.Generator().manual_seed(version)
    return {f"w{i}": torch.randn(kib * 256, generator=g) for i in range(tensors)}


def _weight_sync(store, weight_syncs: dict, op: str, req: dict):
    """``ws_publish``: publishes ``ws_state(version, tensors, kib)``. ``ws_pull``: pulls the
    latest version into zeros and answers which version's state the result equals (the
    digests are the agent's own, of the state it generates), its relay position, its reader
    and publish ids, the phases of its pull's timeline and the error, if any;
    ``kill_relay_at``: the relay at chain position 0 SIGKILLs itself before it stages that
    bucket; ``kill_relay_at_part``: it SIGKILLs itself once it has committed that many parts
    (mid-bucket: the next host has read part of the bucket from it)."""
    from mooncake_store import WeightSync, WeightSyncConfig, tensor_digest

    ws = weight_syncs.get(req["model"])
    if ws is None:
        ws = WeightSync(store, req["model"], config=WeightSyncConfig(**req.get("config", {})))
        weight_syncs[req["model"]] = ws
    if op == "ws_publish":
        state = ws_state(req["version"], req["tensors"], req["kib"])
        return ws.publish(state, req["version"]).buckets
    import torch

    model = {k: torch.zeros_like(t) for k, t in ws_state(0, req["tensors"], req["kib"]).items()}
    kill_at = req.get("kill_relay_at")

    def hook(i):
        if i == kill_at and ws.puller.relay is not None and ws.puller.relay.position == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    kill_part = req.get("kill_relay_at_part")
    if kill_part is not None:
        from mooncake_store.weight_sync import relay as relay_mod

        mark, seen = relay_mod.RelayPull._mark, []

        def mark_then_kill(self, phase, detail):  # fault injection: dies after a commit
            mark(self, phase, detail)
            if phase == "committed" and self.position == 0:
                seen.append(detail)
                if len(seen) == kill_part:
                    os.kill(os.getpid(), signal.SIGKILL)

        relay_mod.RelayPull._mark = mark_then_kill
    out = {"error": None, "position": None, "phases": [], "first_byte_requests": None}
    try:
        res = ws.pull(model, stage_hook=hook)
        out["position"] = res.relay_position
        out["phases"] = [[e.phase, e.detail] for e in res.timeline]
        out["first_byte_requests"] = next(
            (e.master_requests for e in res.timeline if e.phase == "first_byte"), None
        )
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    got = {k: tensor_digest(t) for k, t in model.items()}
    out["version"] = ws.version
    # what names this reader's relay copies (docs/weight-sync.md: <pid>/r<rid>/b<s>.<i>.p<j>)
    out["rid"], out["pid"] = ws.puller.rid, ws.puller.held_pid
    out["equals"] = [
        v
        for v in range(ws.version + 1)
        if got == {k: tensor_digest(t) for k, t in ws_state(v, req["tensors"], req["kib"]).items()}
    ]
    return out


if __name__ == "__main__":
    _agent_main()
