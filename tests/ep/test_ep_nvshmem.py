"""The low-latency backend of ``mooncake_ep.Buffer``: NVSHMEM or the process group.

* Configuration: ``EPConfig(low_latency_backend=...)`` and
  ``MOONCAKE_EP_LOW_LATENCY_BACKEND`` (parsing, validation, explicit over environment).
* Selection on real rank processes (CPU tensors, no NVSHMEM here): ``auto`` falls back to
  the group, records it (``Buffer.low_latency_backend``, ``low_latency_fallback_reason``)
  and returns the group path's results bit for bit; ``nvshmem`` raises ``ValueError`` on
  every rank before any token moves (CPU tensors; ``nvshmem.core`` not importable), naming
  op, rank, expected and actual; ranks that disagree on the backend raise everywhere; the
  group works afterwards.
* The NVSHMEM protocol itself (unique-id bootstrap over the group, collective symmetric
  buffers, put-with-signal into each peer's slot, barrier, signal wait, compaction) runs
  against ``fake_nvshmem`` (nvshmem4py's names and signatures, shared files instead of GPU
  memory; CPU tensors allowed through a test-only switch): low-latency dispatch, combine,
  backward and fp8 equal the group path bit for bit at 2 and 4 ranks, buffers grow for
  float64 rows, a failed init raises everywhere (``nvshmem``) or falls back (``auto``).
* Where nvshmem4py is installed without a GPU (a scratch venv, not CI): the real
  library's unique id crosses the group and its init fails cleanly on every rank.
* On a GPU with a CUDA build and nvshmem4py: the real NVSHMEM path against the group path
  (skipped elsewhere; ``tests/device/gpu_checks.py`` step ``ep_nvshmem`` runs it too).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import REPO_ROOT
from tests.ep import eputil

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------ configuration


def test_config_and_environment(monkeypatch):
    import mooncake_ep
    from mooncake_ep.config import env_defaults, resolve

    monkeypatch.delenv("MOONCAKE_EP_LOW_LATENCY_BACKEND", raising=False)
    assert env_defaults()["low_latency_backend"] == "auto"
    assert resolve(None, 2)["low_latency_backend"] == "auto"
    for raw, want in (("nvshmem", "nvshmem"), ("group", "group"), ("auto", "auto"), ("", "auto")):
        monkeypatch.setenv("MOONCAKE_EP_LOW_LATENCY_BACKEND", raw)
        assert env_defaults()["low_latency_backend"] == want, raw
    for raw in ("GROUP", " auto "):  # exact values, as MOONCAKE_EP_KERNELS and EPConfig take them
        monkeypatch.setenv("MOONCAKE_EP_LOW_LATENCY_BACKEND", raw)
        with pytest.raises(ValueError, match="MOONCAKE_EP_LOW_LATENCY_BACKEND must be one of"):
            env_defaults()
    monkeypatch.setenv("MOONCAKE_EP_LOW_LATENCY_BACKEND", "nvshmem")
    # explicit options win over the environment
    assert (
        resolve(mooncake_ep.EPConfig(low_latency_backend="group"), 2)["low_latency_backend"]
        == "group"
    )
    assert resolve(mooncake_ep.EPConfig(), 2)["low_latency_backend"] == "nvshmem"
    monkeypatch.setenv("MOONCAKE_EP_LOW_LATENCY_BACKEND", "ibgda")
    with pytest.raises(
        ValueError, match="MOONCAKE_EP_LOW_LATENCY_BACKEND must be one of .*'ibgda'"
    ):
        env_defaults()
    # an explicit option wins, also over a malformed variable (which is then not read)
    assert (
        resolve(mooncake_ep.EPConfig(low_latency_backend="group"), 2)["low_latency_backend"]
        == "group"
    )
    with pytest.raises(ValueError, match="low_latency_backend must be one of .*'nccl'"):
        mooncake_ep.EPConfig(low_latency_backend="nccl")


def test_config_types_are_checked():
    """A config of another type, or a flag given as a string, is refused by name (a dict
    reached the kernels as an AttributeError, and "0" meant True)."""
    import mooncake_ep
    from mooncake_ep.config import resolve

    with pytest.raises(TypeError, match="config must be an EPConfig or None, got dict"):
        resolve({"kernels": "torch"}, 2)
    for bad in ("0", 1, "yes"):
        with pytest.raises(ValueError, match="fp32_accumulate must be a bool or None"):
            mooncake_ep.EPConfig(fp32_accumulate=bad)
    assert resolve(mooncake_ep.EPConfig(fp32_accumulate=False), 2)["fp32_accumulate"] is False


def test_nvshmem_import_is_lazy_and_guarded():
    """Importing mooncake_ep does not import nvshmem; without it the reason says so."""
    import subprocess
    import sys

    code = (
        "import sys, torch, mooncake_ep; from mooncake_ep import _nvshmem as n; "
        "assert 'nvshmem' not in sys.modules and 'mooncake_ep._nvshmem' in sys.modules; "
        "print(n.local_unusable(torch.device('cpu'), 0, 1, [0])); "
        "n._TEST_ALLOW_CPU = True; print(n.local_unusable(torch.device('cpu'), 0, 1, [0]))"
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [
                REPO_ROOT,
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()
    assert first == "expected CUDA tensors, got x on cpu"
    try:
        import nvshmem.core  # noqa: F401

        has = True
    except Exception:
        has = False
    if not has:
        assert second.startswith("nvshmem.core does not import") and "nvshmem4py-cu13" in second, (
            second
        )


# ------------------------------------------------------------------ selection (no NVSHMEM)

E_PER_RANK, K, H, T = 2, 3, 24, 6


def _ll_round(buf, rank, ws, dtype=torch.float32, seed=3, fp8=False, backward=True, device="cpu"):
    """low_latency_dispatch + combine (+ backward, + fp8 dispatch); results on CPU, rows past
    recv_count left out (uninitialised by contract)."""
    E = E_PER_RANK * ws
    L = E // ws
    x, idx, w = (
        t.to(device) for t in eputil.make_inputs(rank, T + rank % 2, H, E, K, dtype, seed, 0.2)
    )
    Tm = T + 2
    xg = x.clone().requires_grad_(backward)
    wg = w.clone().requires_grad_(backward)
    ll = buf.low_latency_dispatch(xg, idx, Tm, E)
    f = torch.tensor([float(rank * L + l + 1) for l in range(L)], device=device).view(L, 1, 1)
    y = (ll.recv_x.float() * f).to(ll.recv_x.dtype)  # local expert e multiplies by e + 1
    out = buf.low_latency_combine(y, idx, wg, ll.handle).combined_x
    res = {
        "count": ll.recv_count.clone(),
        "out": out.detach().clone(),
        "backend": buf.low_latency_backend,
        "handle_backend": ll.handle.backend,
    }
    for l, n in enumerate(ll.recv_count.tolist()):
        res[f"x{l}"] = ll.recv_x[l, :n].detach().clone()
    if backward:
        (out.float() * torch.arange(H, device=device).float()).sum().backward()
        res["gx"], res["gw"] = xg.grad.clone(), wg.grad.clone()
    if fp8:
        q = buf.low_latency_dispatch(x, idx, Tm, E, use_fp8=True)
        for l, n in enumerate(q.recv_count.tolist()):
            res[f"q{l}"] = q.recv_x[0][l, :n].contiguous().view(torch.uint8).clone()
            res[f"s{l}"] = q.recv_x[1][l, :n].clone()
    res["device"] = str(ll.recv_x[0].device if fp8 else ll.recv_x.device)
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in res.items()}


def _equal(a, b, close=()):
    """Bit for bit, except ``close`` keys: within one bf16 rounding (sums that CUDA's
    index_add_ adds in no fixed order)."""
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            if k in close:
                torch.testing.assert_close(a[k].float(), b[k].float(), rtol=2**-7, atol=1e-5)
            else:
                assert torch.equal(a[k], b[k]), f"{k} differs"


def rank_selection(rank, ws):
    import mooncake_ep
    from mooncake_ep import _nvshmem

    cfg = mooncake_ep.EPConfig
    out = {}
    b_auto = mooncake_ep.Buffer()
    b_group = mooncake_ep.Buffer(config=cfg(low_latency_backend="group"))
    out["before"] = b_auto.low_latency_backend
    ref = _ll_round(b_group, rank, ws, fp8=True)
    got = _ll_round(b_auto, rank, ws, fp8=True)
    out["ref"], out["auto"] = ref, got
    out["group_reason"] = b_group.low_latency_fallback_reason
    out["auto_reason"] = b_auto.low_latency_fallback_reason
    errs = {}

    def attempt(name, fn):
        try:
            fn()
            errs[name] = None
        except ValueError as e:
            errs[name] = str(e)

    b_forced = mooncake_ep.Buffer(config=cfg(low_latency_backend="nvshmem"))
    E = E_PER_RANK * ws
    x, idx, _ = eputil.make_inputs(rank, T, H, E, K)
    attempt("forced_cpu", lambda: b_forced.low_latency_dispatch(x, idx, T, E))
    os.environ["MOONCAKE_EP_LOW_LATENCY_BACKEND"] = "nvshmem"
    try:
        b_env = mooncake_ep.Buffer()
    finally:
        del os.environ["MOONCAKE_EP_LOW_LATENCY_BACKEND"]
    attempt("forced_env", lambda: b_env.low_latency_dispatch(x, idx, T, E))
    # "not installed": CPU tensors let through, nvshmem.core does not import here
    _nvshmem._reset_for_tests()
    _nvshmem._TEST_ALLOW_CPU = True
    try:
        attempt("forced_not_installed", lambda: b_forced.low_latency_dispatch(x, idx, T, E))
    finally:
        _nvshmem._reset_for_tests()
    # one rank forces NVSHMEM, the others run auto: every rank raises
    b_mixed = mooncake_ep.Buffer(config=cfg(low_latency_backend="nvshmem" if rank == 1 else "auto"))
    attempt("mixed", lambda: b_mixed.low_latency_dispatch(x, idx, T, E))
    b_dis = mooncake_ep.Buffer(config=cfg(low_latency_backend="group" if rank == 0 else "auto"))
    attempt("disagree", lambda: b_dis.low_latency_dispatch(x, idx, T, E))
    out["errors"] = errs
    out["after"] = _ll_round(b_auto, rank, ws, backward=False)
    out["after_ref"] = _ll_round(b_group, rank, ws, backward=False)
    return out


@pytest.mark.parametrize("ws", [2])
def test_backend_selection_without_nvshmem(pool_factory, ws):
    """No CUDA tensors and no NVSHMEM here: auto runs the group path (bit for bit the same
    results as low_latency_backend="group", recorded with its reason); nvshmem (EPConfig or
    the environment) raises ValueError on every rank before anything is sent; so do ranks
    that disagree on the backend; the buffer works afterwards."""
    res = pool_factory(ws).run(rank_selection, timeout=120)
    try:
        import nvshmem.core  # noqa: F401

        installed = True
    except Exception:
        installed = False
    for r in range(ws):
        o = res[r]
        assert o["before"] is None
        _equal(o["ref"], o["auto"])
        _equal(o["after"], o["after_ref"])
        assert o["auto"]["backend"] == o["auto"]["handle_backend"] == "group"
        assert o["ref"]["backend"] == "group" and o["group_reason"] is None
        assert "NVSHMEM is not usable on rank(s) [0, 1]" in o["auto_reason"], o["auto_reason"]
        assert f"on rank {r}: expected CUDA tensors, got x on cpu" in o["auto_reason"], o[
            "auto_reason"
        ]
        e = o["errors"]
        for name in ("forced_cpu", "forced_env"):
            msg = e[name]
            assert msg is not None, name
            assert (
                msg.startswith(f"mooncake_ep low_latency_dispatch (rank {r}): ")
                and "nothing was sent" in msg
            ), msg
            assert (
                "low_latency_backend='nvshmem'" in msg
                and "expected CUDA tensors, got x on cpu" in msg
            ), msg
        msg = e["forced_not_installed"]
        assert msg is not None and f"(rank {r})" in msg and "nothing was sent" in msg
        if not installed:
            assert "nvshmem.core does not import" in msg and "nvshmem4py-cu13" in msg, msg
        if r == 1:
            assert "expected CUDA tensors, got x on cpu" in e["mixed"], e["mixed"]
        else:
            assert "rank(s) [1] passed invalid arguments" in e["mixed"], e["mixed"]
        assert (
            "ranks disagree on low_latency_backend" in e["disagree"]
            and "rank 0: 'group'" in e["disagree"]
            and "rank 1: 'auto'" in e["disagree"]
        ), e["disagree"]


# ------------------------------------------------------------------ the protocol, on fake NVSHMEM


def rank_fake_nvshmem(rank, ws, directory):
    import mooncake_ep
    from mooncake_ep import _nvshmem
    from tests.ep import fake_nvshmem as fake

    os.environ["FAKE_NVSHMEM_DIR"] = directory
    fake.install()
    _nvshmem._reset_for_tests()
    _nvshmem._TEST_ALLOW_CPU = True
    try:
        cfg = mooncake_ep.EPConfig
        b_nv = mooncake_ep.Buffer(config=cfg(low_latency_backend="nvshmem"))
        b_grp = mooncake_ep.Buffer(config=cfg(low_latency_backend="group"))
        out = {"runs": {}}
        for dt in (torch.bfloat16, torch.float32):
            out["runs"][str(dt)] = (
                _ll_round(b_grp, rank, ws, dt, fp8=True),
                _ll_round(b_nv, rank, ws, dt, fp8=True),
            )
        calls_before_grow = dict(fake.CALLS)
        # float64 rows are wider than the first allocation: the buffers grow (collectively)
        out["runs"]["float64"] = (
            _ll_round(b_grp, rank, ws, torch.float64),
            _ll_round(b_nv, rank, ws, torch.float64),
        )
        out["grew"] = fake.CALLS["free_tensor"] - calls_before_grow.get("free_tensor", 0)
        # a second Buffer (auto) on the same group: the same NVSHMEM world, its own buffers
        b_auto = mooncake_ep.Buffer()
        out["runs"]["auto"] = (
            _ll_round(b_grp, rank, ws, seed=8),
            _ll_round(b_auto, rank, ws, seed=8),
        )
        # nothing routed anywhere on this rank
        E = E_PER_RANK * ws
        xz = torch.randn(3, H)
        none = torch.full((3, 2), -1, dtype=torch.int64)
        ll = b_nv.low_latency_dispatch(xz, none, 4, E)
        out["empty"] = b_nv.low_latency_combine(
            ll.recv_x, none, torch.ones(3, 2), ll.handle
        ).combined_x
        out["calls"] = dict(fake.CALLS)
        out["token"] = fake._S["token"]
        out["backends"] = (
            b_nv.low_latency_backend,
            b_auto.low_latency_backend,
            b_auto.low_latency_fallback_reason,
        )
        return out
    finally:
        fake.uninstall()
        _nvshmem._reset_for_tests()


@pytest.mark.parametrize("ws", [2, 4])
def test_nvshmem_protocol_on_fake_library(pool_factory, ws, tmp_path):
    """The NVSHMEM exchange (against a CPU stand-in with nvshmem4py's API) gives the group
    path's results bit for bit: low-latency dispatch, combine, backward (both directions
    over NVSHMEM) and fp8; bf16, float32 and float64 (the buffers grow); auto picks NVSHMEM
    when every rank can; one unique id reaches every rank through the group."""
    res = pool_factory(ws, env={"MOONCAKE_TEST_FAKE_NVSHMEM": "1"}).run(
        rank_fake_nvshmem, str(tmp_path), timeout=240
    )
    tokens = {res[r]["token"] for r in range(ws)}
    assert len(tokens) == 1 and None not in tokens
    for r in range(ws):
        o = res[r]
        for name, (ref, got) in o["runs"].items():
            assert got["backend"] == got["handle_backend"] == "nvshmem", (r, name)
            assert ref["backend"] == "group"
            _equal(ref, got)
        assert o["backends"] == ("nvshmem", "nvshmem", None)
        assert torch.equal(o["empty"], torch.zeros(3, H))
        c = o["calls"]
        assert c["init"] == 1 and c["get_unique_id"] == 1, c
        assert c["put_signal_nbi"] > 0 and c["put_bytes"] > 0 and c["signal_wait"] > 0, c
        assert o["grew"] == 2, o["grew"]  # send and receive buffer of one Buffer, once


def rank_fake_init_failure(rank, ws, directory, backend):
    import mooncake_ep
    from mooncake_ep import _nvshmem
    from tests.ep import fake_nvshmem as fake

    os.environ["FAKE_NVSHMEM_DIR"] = directory
    os.environ["FAKE_NVSHMEM_FAIL_INIT"] = "1"
    fake.install()
    _nvshmem._reset_for_tests()
    _nvshmem._TEST_ALLOW_CPU = True
    try:
        buf = mooncake_ep.Buffer(config=mooncake_ep.EPConfig(low_latency_backend=backend))
        ref_buf = mooncake_ep.Buffer(config=mooncake_ep.EPConfig(low_latency_backend="group"))
        out = {}
        try:
            out["got"] = _ll_round(buf, rank, ws)
        except ValueError as e:
            out["error"] = str(e)
        out["ref"] = _ll_round(ref_buf, rank, ws)
        out["reason"] = buf.low_latency_fallback_reason
        # later ops of this Buffer do not try again (every rank knows it failed)
        out["again"] = _ll_round(buf, rank, ws) if backend == "auto" else None
        out["inits"] = fake.CALLS["init"]
        return out
    finally:
        del os.environ["FAKE_NVSHMEM_FAIL_INIT"]
        fake.uninstall()
        _nvshmem._reset_for_tests()


@pytest.mark.parametrize("backend", ["nvshmem", "auto"])
def test_nvshmem_init_failure(pool_factory, backend, tmp_path):
    """NVSHMEM's init fails on rank 1: with "nvshmem" every rank raises ValueError naming
    rank 1 before any token moves; with "auto" every rank falls back to the group (same
    results) and records why."""
    ws = 2
    res = pool_factory(ws, env={"MOONCAKE_TEST_FAKE_NVSHMEM": "1"}).run(
        rank_fake_init_failure, str(tmp_path), backend, timeout=120
    )
    for r in range(ws):
        o = res[r]
        assert o["inits"] == 1, o["inits"]
        if backend == "nvshmem":
            msg = o["error"]
            assert (
                msg.startswith(f"mooncake_ep low_latency_dispatch (rank {r}): ")
                and "nothing was sent" in msg
            )
            assert "NVSHMEM setup failed on rank(s) [1]" in msg, msg
        else:
            assert "error" not in o
            assert o["got"]["backend"] == "group"
            _equal(o["ref"], o["got"])
            _equal(o["ref"], o["again"])
            assert "NVSHMEM setup failed on rank(s) [1]" in o["reason"], o["reason"]


# ------------------------------------------------------------------ real nvshmem4py, no GPU


def _real_nvshmem_without_gpu():
    try:
        import nvshmem.core  # noqa: F401
    except Exception as e:
        return f"nvshmem.core does not import ({type(e).__name__}); CI does not install nvshmem4py-cu13"
    if torch.cuda.is_available():
        return "a GPU is present: tests/device/gpu_checks.py (step ep_nvshmem) covers the real library there"
    return None


def rank_real_nvshmem_no_gpu(rank, ws, backend):
    import mooncake_ep
    from mooncake_ep import _nvshmem

    _nvshmem._reset_for_tests()
    _nvshmem._TEST_ALLOW_CPU = True  # CPU tensors through to the real library's init
    try:
        buf = mooncake_ep.Buffer(config=mooncake_ep.EPConfig(low_latency_backend=backend))
        out = {}
        try:
            out["got"] = _ll_round(buf, rank, ws, backward=False)
        except ValueError as e:
            out["error"] = str(e)
        out["reason"] = buf.low_latency_fallback_reason
        return out
    finally:
        _nvshmem._reset_for_tests()


@pytest.mark.skipif(
    _real_nvshmem_without_gpu() is not None, reason=str(_real_nvshmem_without_gpu())
)
@pytest.mark.parametrize("backend", ["nvshmem", "auto"])
def test_real_nvshmem4py_without_gpu(pool_factory, backend):
    """Where nvshmem4py-cu13 is installed but there is no GPU (a scratch venv; not CI): the
    unique id goes through the group, the real init fails, and every rank raises
    (``nvshmem``) or falls back to the group (``auto``) with the reason."""
    ws = 2
    res = pool_factory(ws, env={"MOONCAKE_TEST_REAL_NVSHMEM": "1"}).run(
        rank_real_nvshmem_no_gpu, backend, timeout=120
    )
    for r in range(ws):
        o = res[r]
        text = o.get("error") or o["reason"]
        assert "NVSHMEM setup failed on rank(s)" in text and "nvshmem.core.init failed" in text, (
            text
        )
        if backend == "nvshmem":
            assert o["error"].startswith(f"mooncake_ep low_latency_dispatch (rank {r}): "), o[
                "error"
            ]
        else:
            assert o["got"]["backend"] == "group"


# ------------------------------------------------------------------ on a GPU with nvshmem4py


def _gpu_nvshmem_ready():
    missing = eputil.gpu_missing()
    if missing is not None:
        return missing
    try:
        import nvshmem.core  # noqa: F401
    except Exception as e:
        return f"nvshmem.core does not import ({type(e).__name__}); pip install nvshmem4py-cu13"
    return None


def rank_cuda_nvshmem(rank, ws):
    import mooncake_ep

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    cfg = mooncake_ep.EPConfig
    nv = mooncake_ep.Buffer(config=cfg(low_latency_backend="nvshmem"))
    grp = mooncake_ep.Buffer(config=cfg(low_latency_backend="group"))
    out = {}
    for dt in (torch.bfloat16, torch.float32):
        out[str(dt)] = (
            _ll_round(grp, rank, ws, dt, fp8=True, device=dev),
            _ll_round(nv, rank, ws, dt, fp8=True, device=dev),
        )
    out["dev"] = str(dev)
    return out


@pytest.mark.skipif(_gpu_nvshmem_ready() is not None, reason=str(_gpu_nvshmem_ready()))
def test_nvshmem_on_cuda_matches_group(pool_factory):
    """On a GPU with a CUDA build and nvshmem4py: low-latency dispatch, combine, backward
    and fp8 over the real NVSHMEM equal the group path (rows, counts, fp8 bit for bit; the
    weighted sums within one bf16 rounding), results on the GPU."""
    ws = 2
    res = pool_factory(ws, env={"MOONCAKE_TEST_NVSHMEM_GPU": "1"}).run(
        rank_cuda_nvshmem, timeout=240
    )
    for r in range(ws):
        o = res[r]
        for name in ("torch.bfloat16", "torch.float32"):
            ref, got = o[name]
            assert got["backend"] == "nvshmem" and ref["backend"] == "group"
            assert got["device"] == o["dev"]
            _equal(ref, got, close=("out", "gx", "gw"))
