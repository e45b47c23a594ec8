"""API details of MooncakeStore with an embedded master (one process): dtypes through
put_tensor, bad input rejected with ValueError before anything is sent, options."""

import re

import pytest

torch = pytest.importorskip("torch")
from mooncake_store import (  # noqa: E402
    MasterConfig,
    MooncakeStore,
    NoSpaceError,
    ObjectNotFoundError,
    ReplicateConfig,
    StoreConfig,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def store():
    s = MooncakeStore(segment_size=32 << 20, serve_tcp=False)
    yield s
    s.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(5, 3).to(torch.float8_e4m3fn),
        lambda: torch.randn(5, 3).to(torch.float8_e5m2),
        lambda: torch.tensor([True, False, True]),
        lambda: torch.randn(4, dtype=torch.complex64),
        lambda: (torch.arange(7, dtype=torch.int32) + 60000).to(torch.uint16),
        lambda: torch.arange(-3, 3, dtype=torch.int8),
        lambda: torch.tensor(3.5),
        lambda: torch.randn(2, 3, 4, dtype=torch.float64).transpose(0, 2),
        lambda: torch.randn(3, 8, dtype=torch.bfloat16),
        lambda: torch.empty(0, 128, dtype=torch.bfloat16),
    ],
    ids=[
        "f8e4m3",
        "f8e5m2",
        "bool",
        "complex64",
        "uint16",
        "int8",
        "0-dim",
        "transposed-f64",
        "bf16",
        "empty-bf16",
    ],
)
def test_tensor_dtypes_round_trip(store, make):
    t = make()
    key = f"t-{t.dtype}-{tuple(t.shape)}-{t.stride()}"
    store.put_tensor(key, t, upsert=True)
    g = store.get_tensor(key)
    assert g.dtype == t.dtype and g.shape == t.shape
    assert torch.equal(
        g.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)
    )


def test_dtypes_without_copy_kernels_are_refused_by_put_tensor(store):
    """torch.uint4 and friends have no copy kernel: put_tensor accepted them and every
    get_tensor failed with NotImplementedError; now put_tensor raises ValueError naming the
    dtype before anything is stored, and the tensor's bytes go in as uint8."""
    for name in ("int4", "uint4", "uint1"):
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        t = torch.zeros(8, dtype=torch.uint8).view(dt)
        with pytest.raises(ValueError, match=f"put_tensor: dtype torch.{name} cannot be stored"):
            store.put_tensor(f"sub-byte-{name}", t)
        assert not store.exists(f"sub-byte-{name}")
    raw = torch.arange(8, dtype=torch.uint8)
    store.put_tensor("sub-byte-bytes", raw, upsert=True)
    assert torch.equal(store.get_tensor("sub-byte-bytes"), raw)


def test_get_into(store):
    store.put("gi", b"0123456789", ReplicateConfig())
    buf = bytearray(16)
    assert store.get_into("gi", buf) == 10 and bytes(buf[:10]) == b"0123456789"
    small = bytearray(4)
    with pytest.raises(ValueError, match="^get_into: buffer of 4 bytes is too small for 'gi'"):
        store.get_into("gi", small)
    assert small == bytearray(4)
    with pytest.raises(ValueError, match="read-only"):
        store.get_into("gi", b"x" * 16)
    t = torch.zeros(10, dtype=torch.uint8)
    assert store.get_into("gi", t) == 10 and bytes(t.numpy()) == b"0123456789"
    sizes = store.get_into_batch(
        ["gi", "missing"], [bytearray(10), bytearray(10)], return_exceptions=True
    )
    assert sizes[0] == 10 and isinstance(sizes[1], ObjectNotFoundError)


def test_bad_input_is_rejected_before_sending(store):
    before = store.stats()
    for bad in (
        lambda: store.put("", b"x"),
        lambda: store.put(5, b"x"),
        lambda: store.put("k", "str"),
        lambda: store.put("k", object()),
        lambda: store.put_batch(["a", "a"], [b"", b""]),
        lambda: store.put_batch(["a", "b"], [b""]),
        lambda: store.put("k", b"x", config=3),
        lambda: store.get_batch("ab"),
        lambda: store.put("k" * 5000, b"x"),
        lambda: store.put_tensor("k", b"not a tensor"),
        lambda: store.put_tensor("k", torch.eye(3).to_sparse()),  # was: RuntimeError from torch
        lambda: store.get_into("k", torch.zeros(9).to_sparse()),
    ):
        with pytest.raises(ValueError):
            bad()
    after = store.stats()
    assert after.puts == before.puts and after.pending == 0 and not store.exists("k")
    for op, call in (
        ("put", lambda: store.put("k", b"x", {"replica_num": 2})),
        ("upsert", lambda: store.upsert("k", b"x", {"replica_num": 2})),
        ("put_batch", lambda: store.put_batch(["k"], [b"x"], {"replica_num": 2})),
        ("put_tensor", lambda: store.put_tensor("k", torch.ones(2), {"replica_num": 2})),
    ):
        with pytest.raises(
            ValueError, match=f"^{op}: config must be a mooncake_store.ReplicateConfig, got dict"
        ):
            call()
    assert not store.exists("k")


def test_empty_batches_return_empty_lists():
    """Every batch form takes an empty batch, also with one-round-trip puts on (the
    default): put_batch([], []) raised ProtocolError from the master."""
    with MooncakeStore(serve_tcp=False, segment_size=16 << 20) as s:
        assert s.put_batch([], []) == []
        assert s.put_tensor_batch([], []) == []
        assert s.put_batch([], [], upsert=True) == []
        assert (
            s.get_batch([]) == []
            and s.get_into_batch([], []) == []
            and s.get_tensor_batch([]) == []
        )
        assert s.exists_batch([]) == [] and s.remove_batch([]) == []
        s.put("after", b"ok")  # the client still works
        assert s.get("after") == b"ok"


def test_option_validation():
    with pytest.raises(ValueError):
        ReplicateConfig(replica_num=0)
    with pytest.raises(ValueError):
        ReplicateConfig(replica_num=True)
    with pytest.raises(TypeError):
        ReplicateConfig(2)  # keyword-only
    with pytest.raises(ValueError):
        MasterConfig(low_watermark=0.9, high_watermark=0.5)
    with pytest.raises(ValueError):
        MasterConfig(etcd="no-port")
    with pytest.raises(ValueError):
        StoreConfig(master="bad").resolved()
    with pytest.raises(ValueError):
        StoreConfig(transfer="udp").resolved()
    with pytest.raises(ValueError):
        MooncakeStore(segment_size=100, serve_tcp=False)
    with pytest.raises(ValueError):
        MooncakeStore(StoreConfig(), segment_size=0)


@pytest.mark.parametrize("size", [1, 100, 4096])
def test_segment_size_too_small_names_where_it_came_from(monkeypatch, size):
    """A segment no larger than its 4096-byte header raises ValueError from StoreConfig,
    naming MOONCAKE_STORE_SEGMENT_SIZE when the value came from there; 0 (no segment) and
    4097 are taken."""
    monkeypatch.delenv("MOONCAKE_STORE_SEGMENT_SIZE", raising=False)
    want = "StoreConfig: segment_size must be 0 (no segment) or more than 4096 bytes"
    with pytest.raises(ValueError, match=rf"^{re.escape(want)}.*got {size}$"):
        StoreConfig(segment_size=size).resolved()
    with pytest.raises(ValueError, match=rf"^{re.escape(want)}.*got {size}$"):
        MooncakeStore(segment_size=size, serve_tcp=False)
    monkeypatch.setenv("MOONCAKE_STORE_SEGMENT_SIZE", str(size))
    with pytest.raises(
        ValueError, match=rf"^{re.escape(want)}.*got {size} \(from MOONCAKE_STORE_SEGMENT_SIZE\)$"
    ):
        StoreConfig().resolved()
    for ok in ("0", "4097"):
        monkeypatch.setenv("MOONCAKE_STORE_SEGMENT_SIZE", ok)
        assert StoreConfig().resolved().segment_size == int(ok)


@pytest.mark.parametrize("config", [{"segment_size": 16 << 20}, {}, "segment_size=1"])
def test_config_of_the_wrong_type(config):
    """MooncakeStore(config=...) takes a StoreConfig; a dict (even an empty one) or another
    type raises ValueError naming the expected type instead of failing inside (or, for
    {}, being taken as no config)."""
    with pytest.raises(
        ValueError,
        match=rf"^MooncakeStore: config must be a StoreConfig .*got {type(config).__name__}$",
    ):
        MooncakeStore(config=config)


def test_large_batches_are_split(store):
    """Batches larger than one request may carry (keys per call, frame bytes) are sent in
    several requests; results keep their order."""
    keys = [f"{i:05d}-" + "k" * 1500 for i in range(3000)]  # about 4.5 MB of keys
    vals = [i.to_bytes(4, "little") for i in range(3000)]
    assert store.put_batch(keys, vals) == [1] * 3000
    assert store.get_batch(keys) == vals
    assert all(store.exists_batch(keys))
    assert store.remove_batch(keys, force=True) == [None] * 3000
    assert not any(store.exists_batch(keys))


def test_key_errors_name_the_op_and_the_problem(store):
    """A key that cannot be encoded (a lone surrogate) is a ValueError naming the call, as
    are the other bad arguments; nothing is sent. Valid non-ASCII keys work."""
    before = store.stats()
    bad = "ab\udcff"
    for op, call in (
        ("put", lambda: store.put(bad, b"x")),
        ("upsert", lambda: store.upsert(bad, b"x")),
        ("get", lambda: store.get(bad)),
        ("exists", lambda: store.exists(bad)),
        ("remove", lambda: store.remove(bad)),
        ("where", lambda: store.where(bad)),
        ("put_tensor", lambda: store.put_tensor(bad, torch.zeros(2))),
        ("get_tensor", lambda: store.get_tensor(bad)),
        ("put_batch", lambda: store.put_batch(["ok", bad], [b"", b""])),
        ("get_batch", lambda: store.get_batch(["ok", bad])),
        ("exists_batch", lambda: store.exists_batch([bad])),
        ("get_into", lambda: store.get_into(bad, bytearray(4))),
    ):
        with pytest.raises(
            ValueError,
            match=rf"^{op}: key must be valid Unicode text .*lone surrogate '\\udcff' at index 2",
        ):
            call()
    with pytest.raises(ValueError, match="^put: key must be a non-empty str, got ''"):
        store.put("", b"x")
    with pytest.raises(ValueError, match="^get: key must be a non-empty str, got 5"):
        store.get(5)
    with pytest.raises(
        ValueError, match="^put: key must be at most 4096 bytes of UTF-8, got 4098 bytes"
    ):
        store.put("é" * 2049, b"x")
    with pytest.raises(ValueError, match="^get_into: buffer is read-only"):
        store.get_into("k", b"x" * 16)
    with pytest.raises(ValueError, match="^put: value must be bytes-like"):
        store.put("k", "str")
    with pytest.raises(ValueError, match="^put_tensor: expected a torch.Tensor"):
        store.put_tensor("k", b"x")
    with pytest.raises(
        ValueError, match="^get_batch: keys must be a sequence of str, not a single key"
    ):
        store.get_batch("ab")
    after = store.stats()
    assert after.puts == before.puts and after.pending == 0 and not store.exists("ok")
    for key in ("ключ/é", "emoji-\U0001f600", "é" * 2048):  # non-ASCII, and exactly 4096 bytes
        store.put(key, key.encode())
        assert store.get(key) == key.encode() and store.get_batch([key]) == [key.encode()]
        store.remove(key, force=True)


def test_repeated_keys_reads_serve_each_writes_refuse(store):
    """Reads accept a key more than once (the value at each position); puts and removes
    name the repeated key in a ValueError and write nothing."""
    store.put_batch(["rk-a", "rk-b"], [b"AAA", b"B"])
    store.put_tensor("rk-t", torch.arange(4))
    assert store.get_batch(["rk-a", "rk-b", "rk-a", "rk-a"]) == [b"AAA", b"B", b"AAA", b"AAA"]
    got = store.get_batch(["rk-x", "rk-a", "rk-x"], return_exceptions=True)
    assert (
        isinstance(got[0], ObjectNotFoundError)
        and got[1] == b"AAA"
        and isinstance(got[2], ObjectNotFoundError)
    )
    with pytest.raises(ObjectNotFoundError):
        store.get_batch(["rk-a", "rk-x", "rk-x"])
    assert store.exists_batch(["rk-a", "rk-x", "rk-a", "rk-b"]) == [True, False, True, True]
    t1, t2 = store.get_tensor_batch(["rk-t", "rk-t"])
    assert torch.equal(t1, torch.arange(4)) and torch.equal(t2, torch.arange(4))
    t1[0] = 99  # each position is its own tensor
    assert t2[0] == 0
    b1, b2, b3 = bytearray(8), bytearray(3), torch.zeros(4, dtype=torch.uint8)
    assert store.get_into_batch(["rk-a", "rk-a", "rk-b"], [b1, b2, b3]) == [3, 3, 1]
    assert bytes(b1[:3]) == b"AAA" and bytes(b2) == b"AAA" and bytes(b3[:1].numpy()) == b"B"
    small = store.get_into_batch(
        ["rk-a", "rk-a"], [bytearray(3), bytearray(2)], return_exceptions=True
    )
    assert small[0] == 3 and isinstance(small[1], ValueError) and "too small" in str(small[1])
    before = store.stats()
    for op, call in (
        ("put_batch", lambda: store.put_batch(["rk-n", "rk-m", "rk-n"], [b"1", b"2", b"3"])),
        (
            "put_tensor_batch",
            lambda: store.put_tensor_batch(["rk-n", "rk-n"], [torch.zeros(1)] * 2),
        ),
        ("remove_batch", lambda: store.remove_batch(["rk-a", "rk-a"])),
    ):
        with pytest.raises(ValueError, match=rf"^{op}: key 'rk-[na]' repeats within one batch"):
            call()
    assert store.stats().puts == before.puts and not store.exists("rk-n") and store.exists("rk-a")


def test_preferred_segment_is_a_preference(store):
    """``preferred_segment`` naming no registered segment is accepted: the object is placed
    as without a preference (as in Mooncake, where the preferred segment is tried first and
    allocation falls back to the others)."""
    assert store.put("pref-bogus", b"x", ReplicateConfig(preferred_segment="no-such-segment")) == 1
    assert store.where("pref-bogus").memory == [store.name] and store.get("pref-bogus") == b"x"
    assert store.put("pref-own", b"y", ReplicateConfig(preferred_segment=store.name)) == 1
    assert store.where("pref-own").memory == [store.name]


def test_a_relays_copy_goes_to_its_own_segment_or_nowhere():
    """A weight-sync relay's copies (``store.internal.put_many(..., own_segment_only=True)``)
    are placed in the preferred segment alone: with no room there, the put fails with
    ``NoSpaceError`` and no other segment (another host's, the trainer's) takes the copy."""

    with (
        MooncakeStore(segment_size=8 << 20, serve_tcp=False) as big,
        MooncakeStore(master=big.master_address, segment_size=1 << 20, serve_tcp=False) as small,
    ):
        here = ReplicateConfig(preferred_segment=small.name, pin=True)
        small.internal.put_many(["fits"], [b"x" * (512 << 10)], [b""], here, own_segment_only=True)
        assert small.where("fits").memory == [small.name]
        with pytest.raises(NoSpaceError):
            small.internal.put_many(
                ["too-big"], [b"x" * (2 << 20)], [b""], here, own_segment_only=True
            )
        assert not small.exists("too-big") and big.stats().objects == 1


def test_conjugate_and_negative_views_are_stored_with_their_values(store):
    """Found by new-user trials: put_tensor of a .conj() view failed with torch's "view is
    not supported for conjugate view tensors"; the view's values are stored (reference:
    the materialised tensor)."""
    z = torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j], dtype=torch.complex64)
    for name, t in (("conj", z.conj()), ("neg", z.conj().imag)):
        store.put_tensor(f"view-{name}", t, upsert=True)
        want = t.resolve_conj().resolve_neg().clone()
        assert torch.equal(store.get_tensor(f"view-{name}"), want), name


def test_weight_sync_and_kv_cache_configs_name_the_bad_value():
    """Found by new-user trials: a negative timeout's error did not say what it got,
    checksums="no" was taken (a truthy str: checksums stayed on), a 4 KiB KV model name was
    taken and failed inside every put, and a long name was echoed whole."""
    from mooncake_store import KVCacheConfig, KVCacheStore, WeightSync, WeightSyncConfig

    with pytest.raises(ValueError, match=r"relay_wait_s must be a positive number, got -1$"):
        WeightSyncConfig(relay_wait_s=-1)
    with pytest.raises(ValueError, match=r"hold_ttl_s must be a positive number, got True$"):
        WeightSyncConfig(hold_ttl_s=True)
    with pytest.raises(
        ValueError, match=r"relay_part_bytes must be an int in \[65536, 2\*\*63\), got 4096$"
    ):
        WeightSyncConfig(relay_part_bytes=4096)
    # found by a new-user trial: taken, then publish failed with msgpack's OverflowError
    with pytest.raises(ValueError, match=r"relay_part_bytes must be .*, got 18446744073709551616$"):
        WeightSyncConfig(relay_part_bytes=1 << 64)
    with pytest.raises(ValueError, match=r"bucket_bytes must be an int in .*, got True$"):
        WeightSyncConfig(bucket_bytes=True)
    with pytest.raises(ValueError, match=r"checksums must be a bool, got 'no'$"):
        WeightSyncConfig(checksums="no")
    with pytest.raises(ValueError, match=r"at most 200 chars\), got 'q+'\.\.\. \(4090 chars\)$"):
        KVCacheConfig(model="q" * 4090)
    with pytest.raises(ValueError, match=r"\.\.\. \(5000 chars\)$"):
        WeightSync(None, "m" * 5000)
    with pytest.raises(ValueError, match=r"\.\.\. \(5000 chars\)$"):
        KVCacheStore(None, tenant="t" * 5000)
    # found by a new-user trial: a lone surrogate raised UnicodeEncodeError at the first call
    with pytest.raises(ValueError, match="tenant must be"):
        KVCacheStore(None, tenant="\udcff")
    with pytest.raises(ValueError, match="model"):
        KVCacheConfig(model="m\ud800")
