"""API details of MooncakeStore with an embedded master (one process): dtypes through
put_tensor, bad input rejected with ValueError before anything is sent, options."""
import pytest

torch = pytest.importorskip("torch")
from mooncake_store import (MasterConfig, MooncakeStore, ObjectNotFoundError, ReplicateConfig,  # noqa: E402
                            StoreConfig)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def store():
    s = MooncakeStore(segment_size=32 << 20, serve_tcp=False)
    yield s
    s.close()


@pytest.mark.parametrize("make", [
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
], ids=["f8e4m3", "f8e5m2", "bool", "complex64", "uint16", "int8", "0-dim", "transposed-f64", "bf16", "empty-bf16"])
def test_tensor_dtypes_round_trip(store, make):
    t = make()
    key = f"t-{t.dtype}-{tuple(t.shape)}-{t.stride()}"
    store.put_tensor(key, t, upsert=True)
    g = store.get_tensor(key)
    assert g.dtype == t.dtype and g.shape == t.shape
    assert torch.equal(g.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8))


def test_get_into(store):
    store.put("gi", b"0123456789", ReplicateConfig())
    buf = bytearray(16)
    assert store.get_into("gi", buf) == 10 and bytes(buf[:10]) == b"0123456789"
    small = bytearray(4)
    with pytest.raises(ValueError, match="too small"):
        store.get_into("gi", small)
    assert small == bytearray(4)
    with pytest.raises(ValueError, match="read-only"):
        store.get_into("gi", b"x" * 16)
    t = torch.zeros(10, dtype=torch.uint8)
    assert store.get_into("gi", t) == 10 and bytes(t.numpy()) == b"0123456789"
    sizes = store.get_into_batch(["gi", "missing"], [bytearray(10), bytearray(10)], return_exceptions=True)
    assert sizes[0] == 10 and isinstance(sizes[1], ObjectNotFoundError)


def test_bad_input_is_rejected_before_sending(store):
    before = store.stats()
    for bad in (lambda: store.put("", b"x"), lambda: store.put(5, b"x"), lambda: store.put("k", "str"),
                lambda: store.put("k", object()), lambda: store.put_batch(["a", "a"], [b"", b""]),
                lambda: store.put_batch(["a", "b"], [b""]), lambda: store.put("k", b"x", config=3),
                lambda: store.get_batch("ab"), lambda: store.put("k" * 5000, b"x"),
                lambda: store.put_tensor("k", b"not a tensor")):
        with pytest.raises(ValueError):
            bad()
    after = store.stats()
    assert after.puts == before.puts and after.pending == 0 and not store.exists("k")


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
