"""Weight sync (CASES.md "Weight sync": WS-1, WS-2, WS-4) and a sharded (FSDP2/DTensor)
publish. Real processes: a master and a storage client (the segment owner) started by
store_agents; trainers and rollout workers are ranks of a rank pool (torch.distributed
processes); the test process only orchestrates and compares digests."""

import os
import sys

import pytest

from tests.faults import kill_group
from tests.rankpool import get_pool
from tests.store import store_agents as sa

MiB = 1 << 20
pytestmark = pytest.mark.timeout(300)

_STATE: dict = {}  # per rank process, across calls: readers and models live here


def _start_store(segment_mib):
    m = sa.start_master()
    sa.start_agent({"master": m.address, "segment_size": segment_mib * MiB, "name": "storage"})
    return m.address


# ---------------------------------------------------------------- helpers run in ranks
def _client(addr):
    from mooncake_store import MooncakeStore

    key = ("client", addr)
    if key not in _STATE:
        _STATE[key] = MooncakeStore(serve_tcp=False, master=addr, segment_size=0)
    return _STATE[key]


def _digests(sd) -> dict:
    from mooncake_store import tensor_digest

    return {k: (tensor_digest(v), str(v.dtype), list(v.shape)) for k, v in sd.items()}


def _small_sd(version):
    import torch

    g = torch.Generator().manual_seed(version)
    return {
        "w": torch.randn(64, 32, generator=g),
        "b": torch.randn(32, generator=g).to(torch.bfloat16),
        "step": torch.tensor([version], dtype=torch.int64),
    }


def _ws1_rank(rank, world, addr, op, version=None):
    """rank 0: trainer (a fresh WeightSync each call: no state survives a 'restart'); rank 1: rollout."""
    import torch
    import torch.distributed as dist

    from mooncake_store import StaleVersionError, WeightSync

    out = {}
    if rank == 0 and op == "publish":
        ws = WeightSync(_client(addr), "ws1")
        try:
            ws.publish(_small_sd(version), version)
            out["published"] = version
        except StaleVersionError as e:
            out["stale"] = str(e)
    dist.barrier()
    if rank == 1:
        r = _STATE.setdefault("ws1_reader", WeightSync(_client(addr), "ws1"))
        model = _STATE.setdefault(
            "ws1_model", {k: torch.zeros_like(v) for k, v in _small_sd(0).items()}
        )
        res = r.pull(model)
        out.update(version=r.version, installed=res.installed, digests=_digests(model))
        try:
            r.pull(model, version=1)
            out["went_back"] = True
        except StaleVersionError:
            out["went_back"] = False
    return out


def test_ws1_no_going_back(procs):
    from mooncake_store import tensor_digest

    addr = _start_store(64)
    pool = get_pool(2)
    want = {v: {k: tensor_digest(t) for k, t in _small_sd(v).items()} for v in (1, 2, 3)}

    def check(out, v):
        assert out["version"] == v
        assert {k: d[0] for k, d in out["digests"].items()} == want[
            v
        ]  # reported version matches the tensors

    r = pool.run(_ws1_rank, addr, "publish", 1, timeout=60)
    assert r[0]["published"] == 1 and r[1]["installed"]
    check(r[1], 1)
    r = pool.run(_ws1_rank, addr, "publish", 2, timeout=60)
    check(r[1], 2)
    assert r[1]["went_back"] is False
    # the trainer restarts: a new process with a new client; the master kept running
    _STATE.clear()
    r = pool.run(_ws1_rank_restart, addr, timeout=60)
    assert "stale" in r[0] and "version 1" in r[0]["stale"]
    check(r[1], 2)
    assert r[1]["installed"] is False and r[1]["went_back"] is False
    r = pool.run(_ws1_rank, addr, "publish", 3, timeout=60)
    assert r[0]["published"] == 3
    check(r[1], 3)


def _ws1_rank_restart(rank, world, addr):
    """The restarted trainer: drop the rank's old client (its process state), open a new one."""
    if rank == 0:
        c = _STATE.pop(("client", addr), None)
        if c is not None:
            c.close()
    return _ws1_rank(rank, world, addr, "publish", 1)


# ---------------------------------------------------------------- WS-2
N_BUCKETS = 10


def _ws2_sd(version):
    import torch

    g = torch.Generator().manual_seed(100 + version)
    sd = {}
    for i in range(N_BUCKETS):  # 8 MiB each: fp32 and bf16 alternating
        if i % 2 == 0:
            sd[f"t{i}"] = torch.randn(2 * MiB, generator=g)
        else:
            sd[f"t{i}"] = torch.randn(4 * MiB, generator=g).to(torch.bfloat16)
    return sd


class InjectedError(RuntimeError):
    pass


def _ws2_target(tag):
    """This worker's model for WS-2 (zeros; kept across calls)."""
    import torch

    return _STATE.setdefault(
        (tag, "model"), {k: torch.zeros_like(v) for k, v in _ws2_sd(0).items()}
    )


def _fail_at_bucket_4(rank, fail_rank, seen):
    """A stage hook recording bucket indices; ``fail_rank`` raises at bucket 4."""

    def hook(i):
        seen.append(i)
        if rank == fail_rank and i == 4:
            raise InjectedError(f"worker {rank}: injected failure at bucket 4")

    return hook


def _ws2_store_rank(rank, world, addr, version, fail_rank, tag):
    """rank 0 publishes ``version`` (if not yet); ranks 1..3 pull; ``fail_rank`` raises at bucket 4."""
    import torch.distributed as dist

    from mooncake_store import WeightSync, WeightSyncConfig

    cfg = WeightSyncConfig(bucket_bytes=8 * MiB)
    out = {}
    if rank == 0:
        ws = WeightSync(_client(addr), "ws2", config=cfg)
        if ws.latest_version() < version:
            out["publish"] = ws.publish(_ws2_sd(version), version).buckets
    dist.barrier()
    if rank > 0:
        r = _STATE.setdefault((tag, "reader"), WeightSync(_client(addr), "ws2", config=cfg))
        model = _ws2_target(tag)
        seen = []
        try:
            r.pull(model, stage_hook=_fail_at_bucket_4(rank, fail_rank, seen))
        except InjectedError as e:
            out["error"] = str(e)
        out.update(
            version=r.version,
            digests={k: v[0] for k, v in _digests(model).items()},
            buckets_seen=seen,
        )
    return out


def _want(version):
    from mooncake_store import tensor_digest

    return {k: tensor_digest(t) for k, t in _ws2_sd(version).items()}


def test_ws2_store_path_all_or_nothing(procs):
    addr = _start_store(256)
    pool = get_pool(4)
    want = {v: _want(v) for v in (1, 2)}
    r = pool.run(_ws2_store_rank, addr, 1, -1, "store", timeout=120)
    assert r[0]["publish"] == N_BUCKETS
    for w in (1, 2, 3):
        assert r[w]["version"] == 1 and r[w]["digests"] == want[1]
    r = pool.run(_ws2_store_rank, addr, 2, 2, "store", timeout=120)
    assert "injected" in r[2]["error"]
    assert (
        r[2]["version"] == 1 and r[2]["digests"] == want[1]
    )  # kept and reports its previous version
    assert max(r[2]["buckets_seen"]) == 4  # stopped at the failing bucket
    for w in (1, 3):  # a whole version, old or new, never a mix
        assert r[w]["digests"] == want[r[w]["version"]]
        assert r[w]["version"] == 2
    r = pool.run(_ws2_store_rank, addr, 2, -1, "store", timeout=120)  # worker 2 retries
    for w in (1, 2, 3):
        assert r[w]["version"] == 2 and r[w]["digests"] == want[2]


def _ws2_pg_rank(rank, world, version, fail_rank, tag):
    """The process-group path: rank 0 broadcasts ``version``; ranks 1..3 receive."""
    from mooncake_store import GroupWeightSync, WeightSyncAbortedError

    gs = _STATE.setdefault((tag, "gs"), GroupWeightSync(src=0, bucket_bytes=8 * MiB))
    if rank == 0:
        model = _ws2_sd(version)
    else:
        model = _ws2_target(tag)
    seen = []
    out = {}
    try:
        res = gs.sync(
            model,
            version if rank == 0 else None,
            stage_hook=_fail_at_bucket_4(rank, fail_rank, seen),
        )
        out["buckets"] = res.buckets
    except WeightSyncAbortedError as e:
        out["error"] = str(e)
        out["cause"] = type(e.__cause__).__name__ if e.__cause__ is not None else None
    out.update(version=gs.version, buckets_seen=seen)
    if rank > 0:
        out["digests"] = {k: v[0] for k, v in _digests(model).items()}
    return out


def test_ws2_process_group_path_all_or_nothing():
    pool = get_pool(4)
    want = {v: _want(v) for v in (1, 2)}
    r = pool.run(_ws2_pg_rank, 1, -1, "pg", timeout=120)
    for w in (1, 2, 3):
        assert r[w]["version"] == 1 and r[w]["digests"] == want[1] and r[w]["buckets"] == N_BUCKETS
    r = pool.run(_ws2_pg_rank, 2, 2, "pg", timeout=120)
    for w in range(4):
        assert "aborted at bucket 4" in r[w]["error"], r[w]  # every participant gets an error
        assert max(r[w]["buckets_seen"]) == 4  # nobody started bucket 5
        assert r[w]["version"] == 1
    assert r[2]["cause"] == "InjectedError"
    for w in (1, 2, 3):
        assert r[w]["digests"] == want[1]  # every worker still holds the previous version
    r = pool.run(_ws2_pg_rank, 2, -1, "pg", timeout=120)  # retry succeeds everywhere
    for w in (1, 2, 3):
        assert r[w]["version"] == 2 and r[w]["digests"] == want[2]


def _mixed_sd(version):
    """Several tensors per 16 KiB bucket, of mixed dtypes and odd sizes (a bf16 tensor of
    an odd count leaves the next float32 misaligned in the bucket), some non-contiguous."""
    import torch

    g = torch.Generator().manual_seed(300 + version)
    sd = {}
    for i in range(12):
        if i % 3 == 0:
            sd[f"f{i}"] = torch.randn(1001 + i, generator=g)
        elif i % 3 == 1:
            sd[f"b{i}"] = torch.randn(777 + i, generator=g).to(torch.bfloat16)
        else:
            sd[f"i{i}"] = torch.randint(-(2**40), 2**40, (33, 17), generator=g).t()
    return sd


def _mixed_pg_rank(rank, world):
    """Versions 1 then 2 of _mixed_sd over GroupWeightSync (16 KiB buckets, kept between
    the versions); the receivers' digests after each."""
    import torch

    from mooncake_store import GroupWeightSync

    gs = GroupWeightSync(src=0, bucket_bytes=16384)
    target = {k: torch.zeros_like(v).contiguous() for k, v in _mixed_sd(0).items()}
    out = {}
    for v in (1, 2):
        model = _mixed_sd(v) if rank == 0 else target
        res = gs.sync(model, v if rank == 0 else None)
        out[v] = {"buckets": res.buckets, "digests": _digests(model)}
    return out


def test_group_sync_of_several_tensors_per_bucket_mixed_dtypes():
    """GroupWeightSync stages a bucket of several tensors as views of a buffer it keeps
    between versions (a copy where a tensor sits misaligned in it): two versions in a row
    leave every receiver with each version's tensors, against digests of the source's."""
    pool = get_pool(3)
    r = pool.run(_mixed_pg_rank, timeout=120)
    for v in (1, 2):
        want = _digests({k: t.contiguous() for k, t in _mixed_sd(v).items()})
        for w in (1, 2):
            assert r[w][v]["buckets"] > 1, r[w][v]["buckets"]
            assert r[w][v]["digests"] == want, (w, v)


# ---------------------------------------------------------------- WS-4
def _ws4_sd():
    import torch

    g = torch.Generator().manual_seed(4)
    return {
        "fp32": torch.randn(1000, 33, generator=g),
        "bf16": torch.randn(77, 5, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-(2**40), 2**40, (999,), generator=g, dtype=torch.int64),
        "empty": torch.empty(0, 7),
        "transposed": torch.randn(40, 30, generator=g).t(),
        "big": torch.randn(300 * MiB // 4, generator=g),
    }


def _ws4_rank(rank, world, addr, version):
    import resource

    import torch
    import torch.distributed as dist

    from mooncake_store import WeightSync, WeightSyncConfig

    cfg = WeightSyncConfig(bucket_bytes=16 * MiB, keep_versions=0)
    out = {}
    if rank == 0:
        sd = _STATE.get("ws4_sd")
        if sd is None:
            sd = _STATE["ws4_sd"] = _ws4_sd()
        assert not sd["transposed"].is_contiguous()
        if version == 2:
            sd["big"][12345] += 1.0
        WeightSync(_client(addr), "ws4", config=cfg).publish(sd, version)
        out["digests"] = _digests(sd)
    dist.barrier()
    if rank == 1:
        r = _STATE.setdefault("ws4_reader", WeightSync(_client(addr), "ws4", config=cfg))
        model = _STATE.get("ws4_model")
        if model is None:
            model = _STATE["ws4_model"] = {k: torch.zeros_like(v) for k, v in _ws4_sd().items()}
        res = r.pull(model)
        out.update(version=res.version, digests=_digests(model))
    out["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    if version == 2:
        _STATE.pop("ws4_sd", None)
        _STATE.pop("ws4_model", None)
    return out


def test_ws4_bytes_really_moved(procs):
    addr = _start_store(768)
    pool = get_pool(2)
    r1 = pool.run(_ws4_rank, addr, 1, timeout=180)
    assert r1[1]["version"] == 1
    assert r1[1]["digests"] == r1[0]["digests"]  # hash, dtype and shape per tensor
    r2 = pool.run(_ws4_rank, addr, 2, timeout=180)
    assert r2[1]["version"] == 2 and r2[1]["digests"] == r2[0]["digests"]
    assert r2[0]["digests"]["big"][0] != r1[0]["digests"]["big"][0]
    assert {k for k in r1[0]["digests"] if r1[0]["digests"][k] != r2[0]["digests"][k]} == {"big"}
    peak = sum(x["maxrss_mib"] for x in r2) + 768  # ranks' peak RSS + the storage agent's segment
    assert peak < 4096, peak


# ---------------------------------------------------------------- sharded publish
def _fsdp_rank(rank, world, addr):
    import torch
    import torch.distributed as dist

    from mooncake_store import WeightSync

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 7))
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    sd = model.state_dict()
    from torch.distributed.tensor import DTensor

    assert all(isinstance(v, DTensor) for v in sd.values())
    try:
        WeightSync(_client(addr), "fsdp").publish(sd, 1, shard=rank, num_shards=world)
        raise AssertionError("a sharded publish without publish_id was accepted")
    except ValueError as e:
        assert "publish_id" in str(e)
    pid = [__import__("uuid").uuid4().hex]
    dist.broadcast_object_list(pid, src=0)  # the shards of one publish share its id
    res = WeightSync(_client(addr), "fsdp").publish(
        sd, 1, shard=rank, num_shards=world, publish_id=pid[0]
    )
    dist.barrier()
    return {
        "local_rows": {k: v.to_local().shape[0] for k, v in sd.items()},
        "committed": res.committed,
        "bytes": res.bytes,
        "full": _digests(full),
    }


def test_fsdp2_sharded_publish_pulled_into_plain_model(procs):
    addr = _start_store(64)
    pool = get_pool(2)
    r = pool.run(_fsdp_rank, addr, timeout=120)
    assert [x["committed"] for x in r] == [True, False]
    assert (
        r[0]["local_rows"]["0.weight"] == 17 and r[1]["local_rows"]["0.weight"] == 16
    )  # uneven FSDP2 shards
    # the pieces are each rank's own shards: together one full copy, uneven rows included
    import torch

    from mooncake_store import MooncakeStore, WeightSync

    plain = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 7))
    with MooncakeStore(serve_tcp=False, master=addr, segment_size=0) as s:
        res = WeightSync(s, "fsdp").pull(plain)
        # fp32 trainer -> bf16 rollout: dtype casts on request
        res16 = WeightSync(s, "fsdp").pull(None, dtype=torch.bfloat16)
    assert res.installed and res.version == 1
    assert _digests(plain.state_dict()) == r[0]["full"]
    assert all(
        v.dtype == torch.bfloat16 and torch.equal(v, plain.state_dict()[k].to(torch.bfloat16))
        for k, v in res16.state_dict.items()
    )
    assert r[0]["bytes"] + r[1]["bytes"] >= sum(v.numel() * 4 for v in plain.state_dict().values())


def test_corrupt_or_missing_piece_keeps_the_old_version(procs):
    """A bucket whose bytes changed after the commit (checksum) or that is gone: the pull
    raises WeightSyncAbortedError and the reader keeps its version and tensors."""
    import torch

    from mooncake_store import MooncakeStore, WeightSync, WeightSyncAbortedError, WeightSyncConfig

    addr = _start_store(64)
    cfg = WeightSyncConfig(bucket_bytes=4096)
    with MooncakeStore(serve_tcp=False, master=addr, segment_size=0) as s:
        ws = WeightSync(s, "c", config=cfg)
        ws.publish(_small_sd(1), 1)
        r = WeightSync(s, "c", config=cfg)
        model = {k: torch.zeros_like(v) for k, v in _small_sd(0).items()}
        r.pull(model)
        ws.publish(_small_sd(2), 2)
        import msgpack

        key = f"ws/c/v2/{msgpack.unpackb(s.get('ws/c/v2/commit'))['pid']}/b0.0"  # the committed publish's bucket 0
        good = s.get(key)
        s.upsert(key, bytes([good[0] ^ 1]) + good[1:])
        with pytest.raises(WeightSyncAbortedError, match="checksum"):
            r.pull(model)
        assert r.version == 1 and _digests(model) == _digests(_small_sd(1))
        s.remove(key, force=True)
        with pytest.raises(WeightSyncAbortedError):
            r.pull(model)
        assert r.version == 1 and _digests(model) == _digests(_small_sd(1))
        s.upsert(key, good)
        assert r.pull(model).version == 2 and _digests(model) == _digests(_small_sd(2))


# ---------------------------------------------------------------- install="view"
def _view_cfg(**kw):
    from mooncake_store import WeightSyncConfig

    return WeightSyncConfig(
        bucket_bytes=4096, keep_versions=0, install="view", hold_ttl_s=1.0, **kw
    )


def _zero_module(float_dtype=None):
    import torch

    m = torch.nn.Module()
    for k, v in _small_sd(0).items():
        if v.is_floating_point():
            m.register_parameter(
                k, torch.nn.Parameter(torch.zeros_like(v, dtype=float_dtype), requires_grad=False)
            )
        else:
            m.register_buffer(k, torch.zeros_like(v))
    return m


def _in_store_memory(t) -> bool:
    """Whether the tensor's bytes lie in a mapping of a store segment (a memfd)."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return "mooncake-store-" in line
    return False


def _view_rank(rank, world, addr, op, version=None, dtype=None):
    import time

    import torch
    import torch.distributed as dist

    from mooncake_store import WeightSync

    out = {}
    if rank == 0 and op == "publish":
        ws = _STATE.setdefault(
            "view_trainer", WeightSync(_client(addr), "view", config=_view_cfg())
        )
        out["dropped"] = ws.publish(_small_sd(version), version).dropped
        out["versions"] = ws.committed_versions()
    dist.barrier()
    if rank > 0:
        r = _STATE.setdefault(
            ("view_reader", dtype), WeightSync(_client(addr), "view", config=_view_cfg())
        )
        model = _STATE.setdefault(
            ("view_model", dtype), _zero_module(dtype and getattr(torch, dtype))
        )
        if op == "pull":
            r.pull(model, dtype=None if dtype is None else getattr(torch, dtype))
        elif op == "wait":
            time.sleep(version)
        import gc

        gc.collect()  # views of older versions may sit in reference cycles until a collection
        sd = model.state_dict()
        out.update(
            version=r.version,
            digests={k: d[0] for k, d in _digests(sd).items()},
            dtypes={k: str(v.dtype) for k, v in sd.items()},
            in_store={k: _in_store_memory(v) for k, v in sd.items()},
            held=r.puller.held_versions(),
        )
    return out


def test_view_install_shares_the_published_bytes_and_holds_them(procs):
    """install="view": two readers' parameters become views of the store's memory (no
    copy); the version they use is held (the hold refreshed past hold_ttl_s) so later
    publishes with keep_versions=0 do not drop it and its bytes stay intact; the next pull
    moves the hold and the old version is dropped by the following publish."""
    from mooncake_store import tensor_digest

    addr = _start_store(64)
    pool = get_pool(3)
    want = {v: {k: tensor_digest(t) for k, t in _small_sd(v).items()} for v in (1, 2, 3, 4)}
    r = pool.run(_view_rank, addr, "publish", 1, timeout=60)
    r = pool.run(_view_rank, addr, "pull", timeout=60)
    for out in r[1:]:
        assert out["version"] == 1 and out["digests"] == want[1] and out["held"] == [1]
        assert all(out["in_store"].values()), out["in_store"]
    r = pool.run(
        _view_rank, addr, "wait", 2.5, timeout=60
    )  # > hold_ttl_s: only the refresh keeps v1
    r = pool.run(_view_rank, addr, "publish", 2, timeout=60)
    assert r[0]["dropped"] == [] and r[0]["versions"] == [1, 2]
    r = pool.run(_view_rank, addr, "publish", 3, timeout=60)
    assert r[0]["dropped"] == [2] and r[0]["versions"] == [1, 3]
    for out in r[1:]:  # the readers still use version 1, and its bytes did not change
        assert out["version"] == 1 and out["digests"] == want[1]
    r = pool.run(_view_rank, addr, "pull", timeout=60)
    for out in r[1:]:
        assert out["version"] == 3 and out["digests"] == want[3] and out["held"] == [3]
    r = pool.run(_view_rank, addr, "publish", 4, timeout=60)
    assert r[0]["dropped"] == [1] and r[0]["versions"] == [3, 4]
    for out in r[1:]:
        assert out["version"] == 3 and out["digests"] == want[3]


def test_view_install_with_a_cast_copies_what_it_casts(procs):
    """dtype= with install="view" (the rollout model in float16): cast tensors are copies
    (writable, private memory), tensors that need no cast are views."""
    addr = _start_store(64)
    pool = get_pool(2)
    pool.run(_view_rank, addr, "publish", 1, timeout=60)
    r = pool.run(_view_rank, addr, "pull", None, "float16", timeout=60)[1]
    assert r["version"] == 1
    assert r["dtypes"] == {"w": "torch.float16", "b": "torch.float16", "step": "torch.int64"}
    assert r["in_store"] == {"w": False, "b": False, "step": True}


_WRITE_TO_VIEW = r"""
import sys, torch
from mooncake_store import MooncakeStore, WeightSync, WeightSyncConfig
m = torch.nn.Module()
m.register_parameter("w", torch.nn.Parameter(torch.zeros(1024)))
s = MooncakeStore(serve_tcp=False, master=sys.argv[1], segment_size=0)
r = WeightSync(s, "ro", config=WeightSyncConfig(install="view"))
r.pull(m)
assert m.w.sum().item() == 1024.0
print("pulled", flush=True)
with torch.no_grad():
    m.w.add_(1)
print("wrote", flush=True)
"""


def test_a_write_to_a_viewed_parameter_kills_the_writer_not_the_weights(procs):
    """Views are read-only mappings: a write kills the writing process (SIGSEGV) and the
    published bytes, shared with other readers, stay as published."""
    import signal
    import subprocess

    import torch

    from mooncake_store import MooncakeStore, WeightSync

    addr = _start_store(64)
    with MooncakeStore(serve_tcp=False, master=addr, segment_size=0) as s:
        WeightSync(s, "ro").publish({"w": torch.ones(1024)}, 1)
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([sa.REPO, os.environ.get("PYTHONPATH", "")])
        )
        p = subprocess.run(
            [sys.executable, "-c", _WRITE_TO_VIEW, addr],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            start_new_session=True,
        )
        assert "pulled" in p.stdout and "wrote" not in p.stdout, (p.stdout, p.stderr)
        assert p.returncode == -signal.SIGSEGV, (p.returncode, p.stderr[-2000:])
        got = WeightSync(s, "ro").pull(None).state_dict["w"]
        assert torch.equal(got, torch.ones(1024))


def test_view_install_rejects_what_it_cannot_protect():
    import torch

    from mooncake_store import MooncakeStore, WeightSync, WeightSyncConfig

    with pytest.raises(ValueError, match="install"):
        WeightSyncConfig(install="mmap")
    with pytest.raises(ValueError, match="pin=True"):
        WeightSyncConfig(install="view", pin=False)
    with MooncakeStore(serve_tcp=False, segment_size=1 << 20) as s:
        WeightSync(s, "d").publish({"w": torch.ones(4)}, 1)
        r = WeightSync(s, "d", config=WeightSyncConfig(install="view"))
        with pytest.raises(ValueError, match="nn.Module"):
            r.pull({"w": torch.zeros(4)})
        assert r.version == -1


def test_failed_publish_leaves_nothing_pinned_and_bad_tensors_or_dtypes_are_refused():
    """A publish that fails with NoSpaceError removes the pieces it wrote (they are pinned:
    they used to stay, and every later publish failed the same way, a smaller one too);
    sparse and nested tensors are ValueError before anything is written (was RuntimeError
    from torch); a pull into a tensor of another dtype is ValueError unless both are
    floating-point (an int64 target used to truncate 1.7 to 1 silently)."""
    import torch

    from mooncake_store import MooncakeStore, NoSpaceError, WeightSync, WeightSyncConfig

    with MooncakeStore(serve_tcp=False, segment_size=64 * MiB) as s:
        ws = WeightSync(s, "m", config=WeightSyncConfig(keep_versions=0, bucket_bytes=4 * MiB))
        big = {f"w{i}": torch.full((MiB,), float(i)) for i in range(10)}  # 40 MiB
        ws.publish(big, 1)

        def held():  # objects and the bytes they take (not space reserved for the next puts)
            st = s.stats()
            return st.objects, st.used_bytes - st.reserved_bytes

        before = held()
        for _ in range(3):
            with pytest.raises(NoSpaceError):
                ws.publish(big, 2)  # v1 and v2 do not fit together
            assert held() == before  # nothing of v2 left behind
        small = {f"w{i}": torch.full((16,), float(i) + 0.7) for i in range(10)}
        ws.publish(small, 2)  # fits: nothing of the failed tries holds space
        for bad in (
            torch.eye(3).to_sparse(),
            torch.eye(3).to_sparse_csr(),
            torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),
        ):
            with pytest.raises(ValueError, match="dense"):
                ws.publish({"w0": bad}, 3)
        assert ws.latest_version() == 2
        r = WeightSync(s, "m")
        ints = {k: torch.zeros(16, dtype=torch.int64) for k in small}
        with pytest.raises(ValueError, match="published as torch.float32, into has torch.int64"):
            r.pull(ints)
        assert r.version == -1 and all(int(t.sum()) == 0 for t in ints.values())
        halves = {k: torch.zeros(16, dtype=torch.float16) for k in small}
        r.pull(halves)  # floating-point targets keep their dtype: a cast
        assert r.version == 2
        assert all(torch.equal(halves[k], small[k].to(torch.float16)) for k in small)


_VIEW_READER = r"""
import sys, time, torch
from mooncake_store import MooncakeStore, WeightSync, WeightSyncConfig
m = torch.nn.Module()
m.register_parameter("w", torch.nn.Parameter(torch.zeros(4096), requires_grad=False))
s = MooncakeStore(serve_tcp=False, master=sys.argv[1], segment_size=0)
r = WeightSync(s, "slots", config=WeightSyncConfig(install="view", max_readers=1, hold_ttl_s=1.0))
r.pull(m)
print("in store", "mooncake-store-" in open("/proc/self/maps").read(), flush=True)
time.sleep(60)
"""


def test_view_holds_follow_the_tensors_and_release_copies(procs):
    """Views of a version keep it held while any tensor shares its bytes (one the caller
    detached and kept across later pulls, here), so its bytes never change under it;
    release() turns installed views into private copies; a second module gets the held
    version; non-float casts and empty or out-of-range publishes are refused (all found
    by a new-user trial)."""
    import gc
    import time

    import torch

    from mooncake_store import MooncakeStore, WeightSync, WeightSyncConfig

    m = sa.start_master(
        lease_ttl=0.2
    )  # dropped versions' space is reused 0.2 s after the last read
    sa.start_agent({"master": m.address, "segment_size": 8 * MiB, "name": "storage"})
    addr = m.address
    cfg = WeightSyncConfig(bucket_bytes=1 << 20, keep_versions=0, install="view", hold_ttl_s=1.0)
    with MooncakeStore(serve_tcp=False, master=addr, segment_size=0) as s:
        tr, rd = WeightSync(s, "h", config=cfg), WeightSync(s, "h", config=cfg)
        sd = lambda v: {"w": torch.full((256, 1024), float(v))}  # noqa: E731  1 MiB each
        m = torch.nn.Module()
        m.register_parameter("w", torch.nn.Parameter(torch.zeros(256, 1024), requires_grad=False))
        tr.publish(sd(1), 1)
        rd.pull(m)
        kept = m.w.detach()  # e.g. a rollout engine's cached reference
        for v in range(
            2, 12
        ):  # 8 MiB of segment: later versions reuse freed space, v1's too unless held
            time.sleep(0.3)
            tr.publish(sd(v), v)
            rd.pull(m)
            gc.collect()
            assert torch.equal(m.w, sd(v)["w"]) and torch.equal(kept, sd(1)["w"]), v
        assert rd.puller.held_versions() == [1, 11]
        del kept
        gc.collect()
        assert rd.puller.held_versions() == [11]
        other = torch.nn.Module()
        other.register_parameter(
            "w", torch.nn.Parameter(torch.zeros(256, 1024), requires_grad=False)
        )
        assert rd.pull(other).installed and torch.equal(
            other.w, sd(11)["w"]
        )  # same version, other module
        ptr = m.w.data_ptr()
        rd.release()
        assert m.w.data_ptr() != ptr and torch.equal(m.w, sd(11)["w"])  # a private copy now
        m.w.add_(1)  # writable: no SIGSEGV
        with pytest.raises(ValueError, match="floating-point"):
            rd.pull(m, dtype=torch.int8)
        with pytest.raises(ValueError, match="empty"):
            tr.publish({}, 20)
        with pytest.raises(ValueError, match="2\\*\\*63"):
            tr.publish(sd(1), 2**70)


def test_a_dead_view_readers_slot_is_reclaimed(procs):
    """max_readers=1: a view reader that is SIGKILLed keeps its slot only for hold_ttl_s;
    the next publish reclaims it, and a new reader gets views again (found by a new-user
    trial: slots leaked, later readers silently copied)."""
    import subprocess
    import time

    import torch

    from mooncake_store import MooncakeStore, WeightSync, WeightSyncConfig

    addr = _start_store(16)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([sa.REPO, os.environ.get("PYTHONPATH", "")]))
    with MooncakeStore(serve_tcp=False, master=addr, segment_size=0) as s:
        tr = WeightSync(
            s, "slots", config=WeightSyncConfig(max_readers=1, hold_ttl_s=1.0, keep_versions=0)
        )
        tr.publish({"w": torch.ones(4096)}, 1)

        def reader():
            p = subprocess.Popen(
                [sys.executable, "-c", _VIEW_READER, addr],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                start_new_session=True,
            )
            line = p.stdout.readline()
            return p, line

        p1, line = reader()
        assert line.strip() == "in store True", line
        kill_group(p1, wait_s=10)
        time.sleep(1.5)  # > hold_ttl_s: the dead reader's hold is stale
        tr.publish({"w": torch.full((4096,), 2.0)}, 2)  # reclaims the slot
        p2, line = reader()
        try:
            assert line.strip() == "in store True", line
        finally:
            kill_group(p2, wait_s=10)


_LAPSING_READER = r"""
import sys, time, warnings, torch
from mooncake_store import MooncakeStore, WeightSync, WeightSyncConfig
warnings.simplefilter("always")
m = torch.nn.Module()
m.register_parameter("w", torch.nn.Parameter(torch.zeros(4096), requires_grad=False))
s = MooncakeStore(serve_tcp=False, master=sys.argv[1], segment_size=0)
r = WeightSync(s, "lapse", config=WeightSyncConfig(install="view", hold_ttl_s=1.0))
r.pull(m)
print("pulled", r.version, float(m.w[0]), flush=True)
for _ in range(200):
    time.sleep(0.05)
    if r.lapsed_versions:
        print("lapsed", r.lapsed_versions, flush=True)
        break
r.pull(m)
print("pulled", r.version, r.lapsed_versions, float(m.w[0]), flush=True)
"""


def test_a_view_reader_stopped_past_its_hold_is_told(procs):
    """A view reader stopped (SIGSTOP) longer than hold_ttl_s loses its hold and the
    publisher drops the version it views (its memory is then reused): after SIGCONT the
    reader reports it (``lapsed_versions``, a logged error, a RuntimeWarning) instead of
    silently computing with another version's bytes (found by a new-user trial), and its
    next pull installs the newest version and clears it."""
    import signal
    import subprocess
    import time

    import torch

    from mooncake_store import MooncakeStore, WeightSync, WeightSyncConfig

    addr = _start_store(16)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([sa.REPO, os.environ.get("PYTHONPATH", "")]))
    with MooncakeStore(serve_tcp=False, master=addr, segment_size=0) as s:
        tr = WeightSync(s, "lapse", config=WeightSyncConfig(hold_ttl_s=1.0, keep_versions=0))
        tr.publish({"w": torch.ones(4096)}, 1)
        p = subprocess.Popen(
            [sys.executable, "-c", _LAPSING_READER, addr],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        try:
            assert p.stdout.readline().split() == ["pulled", "1", "1.0"]
            os.killpg(p.pid, signal.SIGSTOP)
            time.sleep(1.5)  # > hold_ttl_s
            for v in (2, 3):
                assert tr.publish({"w": torch.full((4096,), float(v))}, v).committed
            assert 1 not in tr.committed_versions()
            os.killpg(p.pid, signal.SIGCONT)
            out, err = p.communicate(timeout=60)
        finally:
            kill_group(p, wait_s=10)
        lines = out.splitlines()
        assert lines[0] == "lapsed [1]", (out, err[-2000:])
        assert lines[1] == "pulled 3 [] 3.0", (out, err[-2000:])
        assert "were dropped while this reader still had views of them" in err


def test_view_reader_pulls_mixed_with_into_none_and_store_close(procs):
    """Found by a second new-user trial: a pull with into=None then into=model left the
    model on the old version while reporting the new one; closing the store left the
    model's parameters as views that later publishes overwrote; the refresh thread and a
    pull raced on the hold key."""
    import time

    import torch

    from mooncake_store import MooncakeStore, WeightSync, WeightSyncConfig

    m = sa.start_master(lease_ttl=0.2)
    sa.start_agent({"master": m.address, "segment_size": 2 * MiB, "name": "storage"})
    cfg = WeightSyncConfig(keep_versions=0, install="view", hold_ttl_s=0.05)
    with MooncakeStore(serve_tcp=False, master=m.address, segment_size=0) as s:
        tr = WeightSync(s, "x", config=cfg)
        model = torch.nn.Module()
        model.register_parameter("w", torch.nn.Parameter(torch.zeros(4096), requires_grad=False))
        rd_store = MooncakeStore(serve_tcp=False, master=m.address, segment_size=0)
        rd = WeightSync(rd_store, "x", config=cfg)
        for v in range(1, 200):  # the refresh thread ticks every 12.5 ms meanwhile
            tr.publish({"w": torch.full((4096,), float(v))}, v)
            if v % 3 == 0:
                got = rd.pull(None).state_dict["w"]
                assert torch.equal(got, torch.full((4096,), float(v))), v
            else:
                rd.pull(model)
                assert torch.equal(model.w, torch.full((4096,), float(v))), v
        rd_store.close()  # releases the reader: its parameters become private copies
        for v in range(200, 230):
            time.sleep(0.01)
            tr.publish({"w": torch.full((4096,), float(v))}, v)
        assert torch.equal(model.w, torch.full((4096,), 199.0))


# ---------------------------------------------------------------- found by a fourth new-user trial
def _race_sd(version, who):
    """Publisher ``who``'s weights of ``version``: 2 MiB in 32 buckets of 64 KiB (so two
    publishers' writes interleave), every element tells who and which version."""
    import torch

    return {f"t{i}": torch.full((16 * 1024,), float(1000 * who + version)) for i in range(32)}


def _race_rank(rank, world, addr, rounds):
    """ranks 0 and 1: two trainers publishing the same versions at the same moment (an old
    trainer not yet dead and its replacement); rank 2: a rollout worker pulling each."""
    import re

    import torch.distributed as dist

    from mooncake_store import StaleVersionError, WeightSync, WeightSyncConfig

    cfg = WeightSyncConfig(bucket_bytes=64 * 1024, keep_versions=0)
    s = _client(addr)
    out = []
    for v in range(1, rounds + 1):
        dist.barrier()
        rec = {}
        if rank < 2:
            try:
                rec["committed"] = (
                    WeightSync(s, "race", config=cfg).publish(_race_sd(v, rank), v).committed
                )
            except StaleVersionError as e:
                rec["stale"] = str(e)
                pid = re.search(r"this publish \('([0-9a-f]+)'\)", str(e))
                if pid:  # the loser's own pieces are gone
                    pp = f"ws/race/v{v}/{pid.group(1)}/"
                    rec["left"] = sum(
                        s.exists_batch([f"{pp}b0.{i}" for i in range(32)] + [pp + "m0"])
                    )
                elif re.search(rf"version {v} is (already committed|not above)", str(e)):
                    rec["left"] = 0  # refused before writing: the winner had committed first
                else:
                    rec["left"] = "the error names no publish id"
        dist.barrier()
        if rank == 2:
            try:
                got = (
                    _STATE.setdefault("race_reader", WeightSync(s, "race", config=cfg))
                    .pull(None, v)
                    .state_dict
                )
                rec["values"] = sorted({float(x) for t in got.values() for x in t.unique()})
            except Exception as e:
                rec["pull_error"] = f"{type(e).__name__}: {e}"
        out.append(rec)
    _STATE.pop("race_reader", None)
    return {"rounds": out, "objects": s.stats().objects}


def test_two_publishers_of_one_version_commit_exactly_one(procs):
    """Two processes publish the same version at once: exactly one commits, the other gets
    StaleVersionError naming the version and its pieces are removed (or, when it starts
    after the winner committed, is refused before writing any); the committed version is
    complete and holds only the winner's weights, never a mix of both publishers' buckets."""
    addr = _start_store(64)
    pool = get_pool(3)
    rounds = 8
    r = pool.run(_race_rank, addr, rounds, timeout=120)
    for v in range(1, rounds + 1):
        pubs, pulled = [r[0]["rounds"][v - 1], r[1]["rounds"][v - 1]], r[2]["rounds"][v - 1]
        winners = [w for w in (0, 1) if pubs[w].get("committed")]
        assert len(winners) == 1, (v, pubs)
        loser = pubs[1 - winners[0]]
        assert f"version {v} " in loser["stale"], loser
        assert loser["left"] == 0, loser
        assert "pull_error" not in pulled, (v, pulled)
        assert pulled["values"] == [float(1000 * winners[0] + v)], (v, winners, pulled)
    # the last version alone stays (keep_versions=0), nothing of the losers: its 32 buckets,
    # manifest, commit record and attempt record, latest, versions, the reader's slot and hold
    assert r[2]["objects"] == 32 + 1 + 1 + 1 + 2 + 2, r[2]["objects"]


def test_dtypes_without_copy_kernels_are_refused_at_publish():
    """torch.int4 (and uint4, uint1, ...) have no copy kernel: a publish used to accept
    them and every reader failed with a bare NotImplementedError; now the publish raises
    ValueError naming the tensor and dtype before writing anything, and their bytes
    (t.view(torch.uint8)) round-trip."""
    import torch

    from mooncake_store import MooncakeStore, WeightSync

    with MooncakeStore(serve_tcp=False, segment_size=8 * MiB) as s:
        ws = WeightSync(s, "q")
        before = s.stats().objects
        q = torch.arange(16, dtype=torch.uint8).view(torch.int4)
        for dt in ("int4", "uint4", "uint1"):
            if hasattr(torch, dt):
                with pytest.raises(ValueError, match=f"'q': dtype torch.{dt} cannot be published"):
                    ws.publish(
                        {
                            "w": torch.ones(8),
                            "q": torch.zeros(8, dtype=torch.uint8).view(getattr(torch, dt)),
                        },
                        1,
                    )
        assert ws.latest_version() == -1 and s.stats().objects == before
        ws.publish({"w": torch.ones(8), "q": q.view(torch.uint8)}, 1)
        got = WeightSync(s, "q").pull(None).state_dict
        assert torch.equal(got["q"], torch.arange(16, dtype=torch.uint8)) and torch.equal(
            got["w"], torch.ones(8)
        )


def test_publish_waits_for_space_of_dropped_versions_still_leased(procs):
    """A copy-mode reader pulls every version; a dropped version's space comes back only
    when its read lease ends (lease_ttl_s): publishing faster than that used to fail with
    NoSpaceError in a segment of 3.3x the model (README's advice); now the publish waits
    for that space and every version arrives intact."""
    import time

    import torch

    from mooncake_store import MooncakeStore, WeightSync, WeightSyncConfig

    m = sa.start_master(lease_ttl=1.0)
    model_bytes = 8 * MiB
    sa.start_agent({"master": m.address, "segment_size": int(3.3 * model_bytes), "name": "storage"})
    cfg = WeightSyncConfig(bucket_bytes=MiB)  # keep_versions=1: 3 versions at once while publishing
    sd = lambda v: {f"t{i}": torch.full((MiB // 4,), float(v)) for i in range(8)}  # noqa: E731  8 MiB
    with MooncakeStore(serve_tcp=False, master=m.address, segment_size=0) as s:
        tr, rd = WeightSync(s, "lease", config=cfg), WeightSync(s, "lease", config=cfg)
        model = {k: torch.zeros_like(t) for k, t in sd(0).items()}
        t0 = time.monotonic()
        for v in range(1, 9):  # much faster than lease_ttl_s
            tr.publish(sd(v), v)
            assert rd.pull(model).version == v
            assert all(torch.equal(t, sd(v)[k]) for k, t in model.items()), v
        assert time.monotonic() - t0 < 30


def test_view_and_copy_models_keep_publishing_in_a_segment_sized_for_their_buckets(procs):
    """weight_sync_bench at small scale: a view-install model and a copy-install model
    (keep_versions=0) share a segment of four versions plus one bucket, which is what they
    need at once (the version the view readers just left, dropped at the next view
    publish, the viewed one, the latest copy version and the one being written). The
    trainer's small pinned records (attempt, manifest, commit) went into its put
    reservation, wherever that lay; each new reservation left a few pinned KiB in another
    bucket-sized run, and a publish of the second or third round failed with NoSpaceError.
    Here the reservation is the size of a bucket and buckets are above a quarter of it, as
    in the benchmark (64 MiB each by default). Every version arrives intact, the readers
    release the versions they left, and every old version is dropped."""
    import gc

    import torch

    from mooncake_store import MooncakeStore, WeightSync, WeightSyncConfig

    bucket, nbuckets = MiB, 4
    m = sa.start_master(lease_ttl=0.2)  # dropped versions the copy reader read come back soon
    sa.start_agent(
        {"master": m.address, "segment_size": (4 * nbuckets + 1) * bucket, "name": "storage"}
    )

    def cfg(install):
        return WeightSyncConfig(
            bucket_bytes=bucket, keep_versions=0, checksums=False, install=install
        )

    def sd(v):  # one tensor per bucket
        return {f"t{i}": torch.full((bucket // 4,), float(10 * v + i)) for i in range(nbuckets)}

    ways = ("view", "copy")
    tr = MooncakeStore(
        serve_tcp=False, master=m.address, segment_size=0, put_reservation_bytes=bucket
    )
    rds = {w: MooncakeStore(serve_tcp=False, master=m.address, segment_size=0) for w in ways}
    try:
        pubs = {w: WeightSync(tr, "frag-" + w, config=cfg(w)) for w in ways}
        subs = {w: WeightSync(rds[w], "frag-" + w, config=cfg(w)) for w in ways}
        models = {}
        for w in ways:
            models[w] = torch.nn.Module()
            for k, t in sd(0).items():
                models[w].register_parameter(
                    k, torch.nn.Parameter(torch.zeros_like(t), requires_grad=False)
                )
        v, dropped = 0, {w: [] for w in ways}
        for _round in range(5):
            for w in ways:
                v += 1
                dropped[w] += pubs[w].publish(sd(v), v).dropped
                assert subs[w].pull(models[w]).version == v
                gc.collect()
                got = models[w].state_dict()
                assert all(torch.equal(got[k], t) for k, t in sd(v).items()), (w, v)
                assert subs[w].puller.held_versions() == ([v] if w == "view" else [])
                # kept: the latest, and for views the version the readers viewed until now
                kept = [v - 2, v] if w == "view" and v > 1 else [v]
                assert pubs[w].committed_versions() == kept, (w, v)
        assert dropped == {"view": [1, 3, 5], "copy": [2, 4, 6, 8]}
    finally:
        for s in (tr, *rds.values()):
            s.close()


_GWS_DEATH = r"""
import os, sys, torch, torch.distributed as dist
import mooncake_pg
from mooncake_store import GroupWeightSync, WeightSyncAbortedError
rank, initf = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("mooncake", rank=rank, world_size=2, init_method="file://" + initf,
                        pg_options=mooncake_pg.MooncakeOptions(timeout=20.0))
sd = {f"t{i}": torch.full((16384,), float(rank)) for i in range(20)}
def hook(i):
    if rank == 1 and i == 3:
        os.kill(os.getpid(), 9)
gs = GroupWeightSync(src=0, bucket_bytes=65536)
try:
    gs.sync(sd, 1, stage_hook=hook)
    print("synced", flush=True)
except WeightSyncAbortedError as e:
    print("aborted", type(e.__cause__).__name__, gs.version, float(sd["t0"][0]), flush=True)
except Exception as e:
    print("raised", type(e).__name__, flush=True)
os._exit(0)
"""


def test_group_sync_survivor_of_a_dead_rank_raises_weight_sync_aborted(tmp_path):
    """A rank killed mid-sync: the survivor raises WeightSyncAbortedError (as documented),
    chained to the backend's RankFailureError, and keeps its version (was: a bare
    RankFailureError)."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([sa.REPO, os.environ.get("PYTHONPATH", "")]))
    initf = str(tmp_path / "init")
    ps = [
        subprocess.Popen(
            [sys.executable, "-c", _GWS_DEATH, str(r), initf],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for r in range(2)
    ]
    try:
        out0, err0 = ps[0].communicate(timeout=120)
        ps[1].wait(30)
    finally:
        for p in ps:
            kill_group(p, wait_s=10)
    assert ps[1].returncode == -9
    assert out0.split() == ["aborted", "RankFailureError", "-1", "0.0"], (out0, err0[-3000:])


def _gws_refuse_rank(rank, world, case):
    import torch

    from mooncake_store import GroupWeightSync, WeightSyncAbortedError

    sd = {"a": torch.zeros(8, 4), "b": torch.zeros(3)}
    version = 3
    if case == "shape" and rank == 2:
        sd["a"] = torch.zeros(4, 8)
    if case == "version" and rank == 1:
        version = 5
    if case == "version" and rank == 3:
        version = None  # takes the source's
    try:
        GroupWeightSync(src=5 if case == "src" else 0).sync(sd, version)
        return "synced"
    except (WeightSyncAbortedError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def test_group_sync_refusals_name_the_rank_tensor_and_version():
    """Every rank's error names the refusing rank and what differs: the tensor with both
    shapes, or the version a rank passed that differs from the source's."""
    pool = get_pool(4)
    r = pool.run(_gws_refuse_rank, "shape", timeout=60)
    for w in range(4):
        assert (
            "refused version 3" in r[w]
            and "GroupWeightSync.sync (rank 2): 'a' has shape (4, 8), src sends (8, 4)" in r[w]
        ), r[w]
    r = pool.run(_gws_refuse_rank, "version", timeout=60)
    for w in range(4):
        assert "GroupWeightSync.sync (rank 1): passed version 5, src 0 sends 3" in r[w], r[w]
    # a source outside the group: ValueError on every rank before any collective
    r = pool.run(_gws_refuse_rank, "src", timeout=60)
    for w in range(4):
        assert r[w] == (
            f"ValueError: GroupWeightSync.sync (rank {w}): src must be a (global) rank of the "
            "group [0, 1, 2, 3], got 5"
        ), r[w]


def test_pull_before_any_publish_does_nothing(procs):
    """Found by a new-user trial: a rollout worker's pull() before the trainer's first
    publish raised ObjectNotFoundError ("version -1 is not committed"); it now returns
    installed=False like any pull with nothing newer."""
    import torch

    from mooncake_store import MooncakeStore, WeightSync

    m = sa.start_master()
    with MooncakeStore(serve_tcp=False, master=m.address, segment_size=8 << 20) as s:
        ws = WeightSync(s, "nothing-yet")
        target = {"w": torch.zeros(3)}
        r = ws.pull(into=target)
        assert not r.installed and r.version == -1 and ws.version == -1
        assert torch.equal(target["w"], torch.zeros(3))
        ws.publish({"w": torch.ones(3)}, 0)
        assert ws.pull(into=target).installed and torch.equal(target["w"], torch.ones(3))


def test_restarted_trainer_holding_the_memory_sees_its_versions(procs):
    """Found by new-user trials: with the README's setup (the trainer's store contributes
    the memory) the version records lived in the trainer's segment, so a restarted trainer
    saw latest_version() == -1 (or TransferError while the old segment was still listed),
    published version 0 again, and a reader holding version 2 never moved; and with no
    memory left at all, a reader's pull failed with NoSpaceError from writing its hold
    record. Those records now live in the master (metadata of empty objects, which need
    no segment)."""
    import torch

    from mooncake_store import (
        MooncakeStore,
        ObjectNotFoundError,
        WeightSync,
        WeightSyncAbortedError,
    )

    m = sa.start_master()
    with MooncakeStore(serve_tcp=False, master=m.address, segment_size=0) as rs:
        reader = WeightSync(rs, "policy")
        target = {"w": torch.zeros(4)}
        with MooncakeStore(serve_tcp=False, master=m.address, segment_size=16 << 20) as trainer:
            ws = WeightSync(trainer, "policy")
            for v in range(3):
                ws.publish({"w": torch.full((4,), float(v))}, v)
                if v == 1:
                    assert reader.pull(into=target).version == 1
        # the trainer's process is gone, and its segment with every version's bytes
        with pytest.raises((ObjectNotFoundError, WeightSyncAbortedError)) as ei:
            reader.pull(into=target)  # version 2's bytes are gone: the reader keeps version 1
        assert "still listed as committed but its bytes are gone" in str(ei.value), ei.value
        assert reader.version == 1 and torch.equal(target["w"], torch.ones(4))
        assert rs.stats().segments == 0
        rs.put("empty", b"")  # no segment anywhere: an empty object still has a home
        assert rs.get("empty") == b""
        with MooncakeStore(serve_tcp=False, master=m.address, segment_size=16 << 20) as trainer2:
            ws2 = WeightSync(trainer2, "policy")
            assert ws2.latest_version() == 2 and ws2.committed_versions()[-1] == 2
            ws2.publish({"w": torch.full((4,), 3.0)}, 3)
            r = reader.pull(into=target)
            assert (
                r.installed and r.version == 3 and torch.equal(target["w"], torch.full((4,), 3.0))
            )


def test_a_version_committed_again_after_a_master_restart_reaches_the_readers_holding_it(procs):
    """Found by new-user trials: a master restarted without etcd forgets every version. The
    trainer's WeightSync then committed version 0 and version 5 again with other bytes, and
    a reader holding the old 5 kept it (installed=False) while a new reader got the new 5.
    Now the publisher refuses numbers at or below what it committed itself, and a reader
    whose held number was committed by another publish installs that one."""
    import torch

    from mooncake_store import MooncakeStore, StaleVersionError, WeightSync

    m = sa.start_master()
    port = int(m.address.rsplit(":", 1)[1])
    with (
        MooncakeStore(serve_tcp=False, master=m.address, segment_size=16 << 20) as trainer,
        MooncakeStore(serve_tcp=False, master=m.address, segment_size=0) as rs,
    ):
        ws, reader = WeightSync(trainer, "policy"), WeightSync(rs, "policy")
        target = {"w": torch.zeros(64)}
        ws.publish({"w": torch.full((64,), 1.0)}, 5)
        assert reader.pull(into=target).version == 5
        m.kill()
        m = sa.start_master(port=port)
        assert ws.latest_version() == -1  # the records are gone with the old master
        for v in (0, 5):
            with pytest.raises(StaleVersionError, match="committed by this publisher.*publish 6"):
                ws.publish({"w": torch.full((64,), 9.0)}, v)
        restarted = WeightSync(trainer, "policy")  # a restarted trainer knows nothing
        restarted.publish({"w": torch.full((64,), 2.0)}, 0)
        r = reader.pull(into=target)  # below the held version: kept
        assert not r.installed and r.version == 5
        assert torch.equal(target["w"], torch.full((64,), 1.0))
        restarted.publish({"w": torch.full((64,), 3.0)}, 5)
        r = reader.pull(into=target)
        assert r.installed and r.version == 5
        assert torch.equal(target["w"], torch.full((64,), 3.0))
        assert not reader.pull(into=target).installed  # and only once


def test_weight_sync_and_kv_cache_need_a_store():
    """Anything but a MooncakeStore is a TypeError at construction, naming what it got (it
    surfaced as an AttributeError from inside publish or match_prefix)."""
    from mooncake_store import KVCacheStore, WeightSync

    for bad in (None, "127.0.0.1:50051"):
        with pytest.raises(TypeError, match="WeightSync: store must be a MooncakeStore, got"):
            WeightSync(bad, "x")
        with pytest.raises(TypeError, match="KVCacheStore: store must be a MooncakeStore, got"):
            KVCacheStore(bad, tenant="x")


OWNER_VIEW = """
import sys, torch
from mooncake_store import MooncakeStore, WeightSync, WeightSyncConfig
with MooncakeStore(segment_size=16 << 20, serve_tcp=False) as s:
    WeightSync(s, "p").publish({"weight": torch.ones(1, 4)}, 1)
    m = torch.nn.Linear(4, 1, bias=False)
    WeightSync(s, "p", config=WeightSyncConfig(install="view")).pull(into=m)
    print("viewed", m.weight.data.tolist(), flush=True)
    m.weight.data.add_(1)  # the store's memory: must fault, never change the version
    print("wrote", flush=True)
"""


def test_view_in_the_owning_process_is_read_only():
    """A view reader in the process that owns the segment gets a read-only view too (it
    got a writable one: a write changed the published version under every reader)."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([sa.REPO, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(
        [sys.executable, "-c", OWNER_VIEW],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert "viewed [[1.0, 1.0, 1.0, 1.0]]" in p.stdout, (p.stdout, p.stderr)
    assert "wrote" not in p.stdout and p.returncode == -11, (p.returncode, p.stdout, p.stderr)


# ---------------------------------------------------------------- across hosts: relays
_RELAY_STATE = {"tensors": 8, "kib": 1024}  # 8 MiB in buckets of one 1 MiB tensor
_PART = 256 << 10  # relays pass each bucket on in 4 parts


def _hosts(procs, master, readers_per_host, config, reader_seg=16 * MiB, release_leases=True):
    """A trainer agent on host "h0" (it holds the published pieces) and reader agents on
    hosts "h1", "h2", ...: processes that count as different hosts (``host_id``) on one
    machine, so the readers reach the trainer and each other over TCP."""
    seg = 16 * MiB

    def agent(host, size):
        cfg = {"master": master.address, "segment_size": size, "host_id": host}
        if not release_leases:
            cfg["release_leases"] = False
        return procs.start_agent(cfg, serve_tcp=True)

    trainer = agent("h0", 4 * seg)
    readers = [
        agent(f"h{h + 1}", reader_seg) for h, g in enumerate(readers_per_host) for _ in range(g)
    ]
    return trainer, readers


def _pull_all(readers, model, config, **kw):
    for a in readers:
        a.send("ws_pull", model=model, config=config, **_RELAY_STATE, **kw)
    return [a.reply(timeout=120) for a in readers]


def _pull_with_a_kill(readers, model, config, state, **kill):
    """Every reader pulls, the relay named by ``kill`` dying on the way: ``(dead agents,
    the survivors' replies)``."""
    for a in readers:
        a.send("ws_pull", model=model, config=config, **state, **kill)
    dead, survivors = [], []
    for a in readers:
        try:
            survivors.append(a.reply(timeout=120))
        except RuntimeError:  # exited: the killed relay
            dead.append(a)
    return dead, survivors


@pytest.mark.slow
def test_store_pull_across_hosts_one_relay_per_host_in_a_chain(procs):
    """Three hosts of two readers: one reader per host relays (chain positions 0, 1, 2),
    the other reads its relay's copies; every reader holds the trainer's bytes (digests
    of the state it generates itself); each relay holds its copy of every bucket in parts
    (``relay_part_bytes``). A version the trainer drops takes the relays' records and
    copies with it."""
    master = procs.start_master()
    config = {"bucket_bytes": MiB, "keep_versions": 0, "relay_part_bytes": _PART}
    trainer, readers = _hosts(procs, master, [2, 2, 2], config)
    trainer.cmd("ws_publish", model="m", config=config, version=1, **_RELAY_STATE)
    used = trainer.cmd("stats")["used_bytes"]
    got = _pull_all(readers, "m", config)
    # the three relays' copies (a relay that made none would still end with position k)
    state_bytes = _RELAY_STATE["tensors"] * _RELAY_STATE["kib"] << 10
    assert trainer.cmd("stats")["used_bytes"] - used >= 3 * state_bytes
    for g in got:
        assert g["error"] is None and g["version"] == 1 and g["equals"] == [1], g
    positions = [g["position"] for g in got]
    for h in range(3):  # one relay per host
        pair = positions[2 * h : 2 * h + 2]
        assert pair.count(None) == 1, positions
    assert sorted(p for p in positions if p is not None) == [0, 1, 2]
    keys = [f"ws/m/v1/relay/c{k}" for k in range(3)]
    # each relay's copies: every 1 MiB bucket in four parts, named by the relaying reader
    keys += [
        f"ws/m/v1/{g['pid']}/r{g['rid']}/b0.{i}.p{j}"
        for g in got
        if g["position"] is not None
        for i in range(_RELAY_STATE["tensors"])
        for j in range(MiB // _PART)
    ]
    assert len(keys) == 3 + 3 * 8 * 4
    assert all(trainer.cmd("exists", key=k) for k in keys)
    # versions 2 and 3 with no reader pulling: version 1 goes, its relays' keys too
    trainer.cmd("ws_publish", model="m", config=config, version=2, **_RELAY_STATE)
    trainer.cmd("ws_publish", model="m", config=config, version=3, **_RELAY_STATE)
    assert not any(trainer.cmd("exists", key=k) for k in keys)


def test_a_relay_without_room_for_its_copies_steps_down_and_the_chain_goes_on(procs):
    """Three hosts of one reader, segments of 1.5 versions: a relay's copies of version 1
    that the next host read stay leased (``lease_ttl_s``: these readers keep their read
    leases to the end, ``release_leases=False``) after its pull of version 2
    removed them, so it runs out of room midway through version 2. It steps down (its
    position record goes at once, its copies when its pull ends) and every reader still
    ends with the whole version 2. A reader that starts after one stepped down may take the
    freed position: the one that stepped down does not remove that reader's record."""
    master = procs.start_master()
    config = {
        "bucket_bytes": MiB,
        "keep_versions": 0,
        "relay_wait_s": 5.0,
        "relay_part_bytes": _PART,
    }
    state_bytes = _RELAY_STATE["tensors"] * _RELAY_STATE["kib"] << 10
    trainer, readers = _hosts(
        procs, master, [1, 1, 1], config, reader_seg=state_bytes * 3 // 2, release_leases=False
    )
    for v in (1, 2):
        trainer.cmd("ws_publish", model="s", config=config, version=v, **_RELAY_STATE)
        got = _pull_all(readers, "s", config)
        for g in got:
            assert g["error"] is None and g["version"] == v and g["equals"] == [v], (v, g)
        if v == 1:
            assert sorted(g["position"] for g in got) == [0, 1, 2], got
    kept = [g["position"] for g in got if g["position"] is not None]
    assert len(kept) < 3, got  # the relays at positions 0 and 1 of version 1 stepped down
    records = [k for k in range(3) if trainer.cmd("exists", key=f"ws/s/v2/relay/c{k}")]
    assert len(records) == len(kept), (records, got)


@pytest.mark.slow
def test_store_pull_across_hosts_survives_a_relay_killed_mid_pull(procs):
    """The relay that reads from the trainer's host (position 0) is SIGKILLed before it
    stages its third bucket: the readers after it in the chain and its own host's other
    reader move up the chain and end with the whole new version; no reader ever holds a
    mix of versions."""
    master = procs.start_master(client_ttl=1.0)
    config = {"bucket_bytes": MiB, "relay_wait_s": 5.0, "relay_part_bytes": _PART}
    trainer, readers = _hosts(procs, master, [2, 2, 2], config)
    trainer.cmd("ws_publish", model="k", config=config, version=1, **_RELAY_STATE)
    for g in _pull_all(readers, "k", config):
        assert g["error"] is None and g["equals"] == [1], g
    trainer.cmd("ws_publish", model="k", config=config, version=2, **_RELAY_STATE)
    dead, survivors = _pull_with_a_kill(readers, "k", config, _RELAY_STATE, kill_relay_at=2)
    assert len(dead) == 1, (len(dead), survivors)
    for g in survivors:
        assert g["equals"] == [g["version"]], g  # one whole version
        assert g["error"] is None and g["version"] == 2, g


@pytest.mark.slow
def test_a_relay_killed_mid_bucket_leaves_the_readers_after_it_whole(procs):
    """Three hosts of one reader; buckets of three 320 KiB tensors passed on in 256 KiB parts
    (pieces straddle parts, so their digests are taken part by part across part borders).
    The relay at position 0 is SIGKILLed once it has committed five parts: mid-bucket, with
    the next host reading that bucket from it part by part. The readers after it finish the
    bucket from the next source up (the publisher) and end with the whole version 2 (digests
    of the state they generate themselves). The first pull's timeline says where the time
    went: the phases come in order, one per part read."""
    master = procs.start_master(client_ttl=1.0)
    config = {"bucket_bytes": MiB, "relay_wait_s": 5.0, "relay_part_bytes": _PART}
    state = {"tensors": 12, "kib": 320}  # 4 buckets of 960 KiB, 4 parts each
    trainer, readers = _hosts(procs, master, [1, 1, 1], config)
    trainer.cmd("ws_publish", model="p", config=config, version=1, **state)
    for a in readers:
        a.send("ws_pull", model="p", config=config, **state)
    first = [a.reply(timeout=120) for a in readers]
    for g in first:
        assert g["error"] is None and g["equals"] == [1], g
        phases = [p for p, _ in g["phases"]]
        assert phases[: phases.index("first_byte")].count("part") == 0, phases
        assert phases.count("part") == 4 * 4 and phases.count("staged") == 4, phases
        assert phases[-2:] == ["fetched", "installed"], phases
        assert g["first_byte_requests"] > 0, g
    trainer.cmd("ws_publish", model="p", config=config, version=2, **state)
    dead, survivors = _pull_with_a_kill(readers, "p", config, state, kill_relay_at_part=5)
    assert len(dead) == 1 and len(survivors) == 2, (len(dead), survivors)
    for g in survivors:
        assert g["error"] is None and g["version"] == 2 and g["equals"] == [2], g


def test_bucket_digests_taken_part_by_part_equal_whole_digests():
    """``_StreamDigests`` fed a bucket part by part (parts of several sizes, pieces that
    straddle parts, an empty piece) gives each piece the digest xxhash or hashlib computes
    over the whole piece; a flipped byte changes only its piece's; parts out of order give
    no digest (the reader then digests the piece whole)."""
    import hashlib

    import torch

    xxhash = pytest.importorskip("xxhash")
    from mooncake_store.weight_sync.common import _StreamDigests

    g = torch.Generator().manual_seed(3)
    buf = torch.randint(0, 256, (MiB,), dtype=torch.uint8, generator=g)
    spans = [(0, 100_000), (100_032, 300_000), (400_064, 0), (400_064, MiB - 400_064)]
    refs = {
        "xxh3": xxhash.xxh3_128_hexdigest,
        "blake2b": lambda b: hashlib.blake2b(b, digest_size=16).hexdigest(),
    }
    for algo, ref in refs.items():
        pieces = [
            {
                "name": f"p{i}",
                "boff": o,
                "nbytes": n,
                "digest": f"{algo}:{ref(buf[o : o + n].numpy())}",
            }
            for i, (o, n) in enumerate(spans)
        ]
        for part in (64 << 10, 256 << 10, 99_999, MiB):
            d = _StreamDigests(pieces)
            for off in range(0, MiB, part):
                d.feed(buf[off : off + part], off)
            assert [d.result(p) for p in pieces] == [
                p["digest"] if p["nbytes"] else None for p in pieces
            ], (algo, part)
        bad = buf.clone()
        bad[200_000] ^= 1  # in piece 1
        d = _StreamDigests(pieces)
        for off in range(0, MiB, 256 << 10):
            d.feed(bad[off : off + (256 << 10)], off)
        ok = [d.result(p) == p["digest"] for p in pieces]
        assert ok == [True, False, False, True], ok  # the empty piece has no streamed digest
        d = _StreamDigests(pieces)
        d.feed(buf[256 << 10 : 512 << 10], 256 << 10)
        d.feed(buf[: 256 << 10], 0)
        assert all(d.result(p) is None for p in pieces)


def test_swap_install_hands_the_staged_storage_over_and_stages_in_the_old_one():
    """``install="swap"``: after a pull the module's parameters (the same Parameter objects)
    hold the published values in the staged storage, with no install copy; the next pull
    stages into the storage the parameters gave up, so two pulls alternate between two
    buffers. A cast pull, or a target of other strides, is copied into as before."""
    import torch

    from mooncake_store import MooncakeStore, WeightSync, WeightSyncConfig

    with MooncakeStore(segment_size=16 << 20, serve_tcp=False) as s:
        pub = WeightSync(s, "sw")
        reader = WeightSync(s, "sw", config=WeightSyncConfig(install="swap"))
        model = torch.nn.Linear(64, 32)
        w, b = model.weight, model.bias
        ptrs = {w.data_ptr()}
        for v in range(1, 4):
            sd = {"weight": torch.randn(32, 64), "bias": torch.randn(32)}
            pub.publish(sd, v)
            assert reader.pull(into=model).version == v
            assert model.weight is w and model.bias is b
            assert torch.equal(w, sd["weight"]) and torch.equal(b, sd["bias"])
            ptrs.add(w.data_ptr())
        assert len(ptrs) == 2, ptrs  # the original storage and one staging buffer, in turn
        target = {"weight": torch.zeros(64, 32).t(), "bias": torch.zeros(32)}  # other strides
        before = target["weight"].data_ptr()
        sd = {"weight": torch.randn(32, 64), "bias": torch.randn(32)}
        pub.publish(sd, 4)
        reader.pull(into=target)
        assert target["weight"].data_ptr() == before
        assert torch.equal(target["weight"], sd["weight"])
        half = torch.nn.Linear(64, 32).to(torch.bfloat16)
        pub.publish(sd, 5)
        reader.pull(into=half, dtype=torch.bfloat16)
        assert torch.equal(half.weight, sd["weight"].to(torch.bfloat16))
