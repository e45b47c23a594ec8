"""The GPU and RDMA paths as far as a CPU reaches them.

- ``transport="rdma"`` fails at init on every rank with a clear error (expected what, got
  what): on a build without ibverbs, and on a build with it but no active RDMA port (this
  machine); nobody hangs.
- ``mooncake_pg.rdma_devices()`` (NIC discovery) returns records; empty without devices.
- The CUDA-only helpers raise a clear error on a CPU-only build; "cuda" is registered for
  the backend only when the extension was built with CUDA.
- ``MOONCAKE_CUDA_IPC`` is parsed (``MooncakeOptions(cuda_ipc=...)`` wins); a CPU-only build
  reports the CUDA IPC path as unavailable with its reason and holds no IPC code; the CUDA
  build reports ``ipc`` for a one-host group and ``staging: ...`` when switched off.
- The CUDA build (scripts/build_cuda.sh, outside the tree) imports and answers argument
  checks on a machine without a GPU (skips when that build is absent).
- ``tests/device/run_gpu_checks.sh --dry-run`` plans every step and writes its JSON.
- GPU tests (CUDA tensors in the group, stream order) skip here with a reason.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

import mooncake_pg
from mooncake_pg import _C
from tests import REPO_ROOT
from tests.faults import kill_group

pytestmark = pytest.mark.timeout(120)
REPO = REPO_ROOT


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


RDMA_RANK = textwrap.dedent('''
    import sys, torch.distributed as dist, mooncake_pg
    rank, ws, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    transport = sys.argv[4]
    try:
        dist.init_process_group("mooncake", rank=rank, world_size=ws, init_method="file://" + store,
                                pg_options=mooncake_pg.MooncakeOptions(transport=transport, timeout=10))
    except Exception as e:
        print("ERROR", type(e).__name__, str(e).splitlines()[0])
        sys.exit(3)
    print("NO ERROR")
''')


def _init_ranks(transports: list) -> list:
    """Runs RDMA_RANK once per rank (rank r with transport transports[r]) in its own
    session; [(returncode, stdout, stderr)]; fails the test if a rank hangs (60 s)."""
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RDMA_RANK, str(r), str(len(transports)), store, t],
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            for r, t in enumerate(transports)
        ]
        outs = []
        for p in procs:
            try:
                out, err = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                for q in procs:
                    kill_group(q)
                pytest.fail(f"a rank hung at init (transports {transports})")
            outs.append((p.returncode, out, err))
    return outs


def test_rdma_transport_fails_clearly_on_every_rank():
    """transport="rdma" without a usable RDMA port: each of 2 ranks raises at init, naming
    what was expected and what was found, within seconds."""
    if mooncake_pg.WITH_RDMA and any(p.active for d in mooncake_pg.rdma_devices() for p in d.ports):
        pytest.skip("this machine has an active RDMA port: transport='rdma' would initialize")
    for rc, out, err in _init_ranks(["rdma", "rdma"]):
        assert rc == 3, (out, err[-2000:])
        line = next(ln for ln in out.splitlines() if ln.startswith("ERROR"))
        assert "transport 'rdma'" in line, line
        if mooncake_pg.WITH_RDMA:
            assert (
                "expected an RDMA device port in state PORT_ACTIVE" in line
                and "got 0 device(s)" in line
            ), line
        else:
            assert "expected a build with MOONCAKE_WITH_RDMA" in line, line


@pytest.mark.skipif(not mooncake_pg.WITH_RDMA, reason="this extension was built without RDMA")
def test_one_rank_without_rdma_fails_the_others_at_once():
    """Found by a new-user trial: rank 1 asks for transport="rdma" and has no active port,
    rank 0 uses tcp. Rank 1 raised at once and rank 0 waited for its host record for
    torch's 30-minute store timeout; now rank 1 publishes why it failed and rank 0 raises
    within seconds, naming rank 1 and the reason."""
    if any(p.active for d in mooncake_pg.rdma_devices() for p in d.ports):
        pytest.skip("this machine has an active RDMA port: transport='rdma' would initialize")
    t0 = time.monotonic()
    outs = _init_ranks(["tcp", "rdma"])
    assert time.monotonic() - t0 < 30
    (rc0, out0, err0), (rc1, out1, err1) = outs
    assert rc0 == 3 and rc1 == 3, (out0, err0[-2000:], out1, err1[-2000:])
    assert "expected an RDMA device port in state PORT_ACTIVE" in out1, out1
    assert "rank 1 could not set up its transport" in out0 and "PORT_ACTIVE" in out0, out0


def test_rdma_devices_records():
    """NIC discovery: a list of RdmaDevice records (frozen dataclasses); empty here."""
    devs = mooncake_pg.rdma_devices()
    assert isinstance(devs, list)
    for d in devs:
        assert isinstance(d, mooncake_pg.RdmaDevice) and d.name
        for p in d.ports:
            assert (
                isinstance(p, mooncake_pg.RdmaPort)
                and p.port >= 1
                and p.link_layer in ("InfiniBand", "Ethernet")
            )
    if not os.path.exists("/sys/class/infiniband"):
        assert devs == []


def test_rdma_compiled_when_headers_exist():
    """setup.py builds the RDMA transport whenever infiniband/verbs.h exists."""
    if os.environ.get("MOONCAKE_WITH_RDMA") == "0":
        pytest.skip("MOONCAKE_WITH_RDMA=0 at build time")
    assert mooncake_pg.WITH_RDMA == os.path.exists("/usr/include/infiniband/verbs.h")


def test_rdma_options_from_environment(monkeypatch):
    from mooncake_pg.config import resolve

    monkeypatch.setenv("MOONCAKE_RDMA_DEVICE", "mlx5_1:2")
    monkeypatch.setenv("MOONCAKE_RDMA_GID_INDEX", "3")
    s = resolve(mooncake_pg.MooncakeOptions(transport="rdma"))
    assert (s["transport"], s["rdma_device"], s["rdma_gid_index"]) == ("rdma", "mlx5_1:2", 3)
    monkeypatch.setenv("MOONCAKE_RDMA_GID_INDEX", "three")
    with pytest.raises(ValueError, match="MOONCAKE_RDMA_GID_INDEX must be an integer"):
        resolve(None)


def test_cuda_registration_follows_the_build():
    import torch.distributed as dist

    devices = dist.Backend.backend_capability["mooncake"]
    assert ("cuda" in devices) == mooncake_pg.WITH_CUDA, devices
    assert "cpu" in devices


@pytest.mark.skipif(mooncake_pg.WITH_CUDA, reason="this extension was built with CUDA")
def test_cuda_helpers_raise_on_a_cpu_build():
    for fn, args in (
        (_C._cuda_reduce, (torch.zeros(2), [torch.zeros(2)], 0)),
        (_C._cuda_ipc_export, (torch.zeros(2),)),
        (_C._cuda_ipc_reduce_from, (torch.zeros(2), b"", 0, 0)),
    ):
        with pytest.raises(
            RuntimeError, match="expected a build with CUDA .* got a CPU-only build"
        ):
            fn(*args)


def test_cuda_ipc_switch_from_environment(monkeypatch):
    """MOONCAKE_CUDA_IPC (read in mooncake_pg/config.py): on by default, 0/false/off force
    pinned host staging, an explicit MooncakeOptions(cuda_ipc=...) wins, junk raises."""
    from mooncake_pg.config import resolve

    monkeypatch.delenv("MOONCAKE_CUDA_IPC", raising=False)
    assert resolve(None)["cuda_ipc"] is True
    for raw, want in (
        ("0", False),
        ("false", False),
        ("off", False),
        ("1", True),
        ("on", True),
        ("", True),
    ):
        monkeypatch.setenv("MOONCAKE_CUDA_IPC", raw)
        assert resolve(None)["cuda_ipc"] is want, raw
    monkeypatch.setenv("MOONCAKE_CUDA_IPC", "0")
    assert resolve(mooncake_pg.MooncakeOptions(cuda_ipc=True))["cuda_ipc"] is True
    monkeypatch.setenv("MOONCAKE_CUDA_IPC", "1")
    assert resolve(mooncake_pg.MooncakeOptions(cuda_ipc=False))["cuda_ipc"] is False
    monkeypatch.setenv("MOONCAKE_CUDA_IPC", "sometimes")
    with pytest.raises(ValueError, match="MOONCAKE_CUDA_IPC must be 0 or 1, got 'sometimes'"):
        resolve(None)
    monkeypatch.delenv("MOONCAKE_CUDA_IPC")
    assert resolve(mooncake_pg.MooncakeOptions(cuda_ipc=0))["cuda_ipc"] is False
    for bad in ("0", "false", 2, 0.0):  # bool("0") is True: strings are refused, not guessed
        with pytest.raises(ValueError, match="MooncakeOptions.cuda_ipc must be True or False"):
            resolve(mooncake_pg.MooncakeOptions(cuda_ipc=bad))


CUDA_PATH_RANK = textwrap.dedent('''
    import json, os, sys, tempfile, torch.distributed as dist, mooncake_pg
    d = tempfile.mkdtemp()
    dist.init_process_group("mooncake", rank=0, world_size=1, init_method="file://" + os.path.join(d, "s"))
    r = {"default": mooncake_pg.cuda_path(),
         "off": mooncake_pg.cuda_path(dist.new_group([0], pg_options=mooncake_pg.MooncakeOptions(cuda_ipc=False)))}
    dist.destroy_process_group()
    print("RESULT " + json.dumps(r))
''')


@pytest.mark.skipif(mooncake_pg.WITH_CUDA, reason="this extension was built with CUDA")
def test_cuda_ipc_unavailable_on_a_cpu_build():
    """A CPU-only build reports the CUDA IPC path as unavailable, with the reason, for every
    setting of the switch, and its extension holds no IPC code."""
    for env in ({}, {"MOONCAKE_CUDA_IPC": "0"}):
        p = subprocess.run(
            [sys.executable, "-c", CUDA_PATH_RANK],
            env=_env(**env),
            capture_output=True,
            text=True,
            timeout=100,
        )
        assert p.returncode == 0, p.stdout + p.stderr[-3000:]
        r = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
        for v in r.values():
            assert v == "unavailable: this build has no CUDA (rebuild with MOONCAKE_WITH_CUDA=1)", r
    if shutil.which("nm"):
        syms = subprocess.run(
            ["nm", "-C", _C.__file__], capture_output=True, text=True, timeout=60
        ).stdout
        assert "CudaIpc" not in syms and "ipc_event_open" not in syms


CUDA_BUILD_SMOKE = textwrap.dedent('''
    import json, torch, torch.distributed as dist
    import mooncake_pg
    from mooncake_pg import _C
    r = {"WITH_CUDA": mooncake_pg.WITH_CUDA, "cuda_available": torch.cuda.is_available(),
         "devices": dist.Backend.backend_capability["mooncake"]}
    # argument checks of the CUDA helpers are reachable without a GPU
    try:
        _C._cuda_reduce(torch.zeros(4), [torch.zeros(4)], 0)
    except ValueError as e:
        r["reduce_check"] = str(e).splitlines()[0]
    try:
        _C._cuda_ipc_export(torch.zeros(4))
    except ValueError as e:
        r["ipc_check"] = str(e).splitlines()[0]
    # a CPU op of the CUDA build (1 rank)
    import tempfile, os
    d = tempfile.mkdtemp()
    dist.init_process_group("mooncake", rank=0, world_size=1, init_method="file://" + os.path.join(d, "s"))
    x = torch.ones(8); dist.all_reduce(x)
    r["cpu_all_reduce"] = x.tolist() == [1.0] * 8
    pg = dist.distributed_c10d._get_default_group()
    # registered for cpu and cuda: one backend object serves both devices
    r["one_backend"] = pg._get_backend(torch.device("cpu")) is pg._get_backend(torch.device("cuda"))
    # all_reduce's path for CUDA tensors: IPC on one host unless switched off
    r["cuda_path"] = mooncake_pg.cuda_path()
    r["cuda_path_off"] = mooncake_pg.cuda_path(dist.new_group([0], pg_options=mooncake_pg.MooncakeOptions(cuda_ipc=False)))
    dist.destroy_process_group()
    # more seats than the IPC reduction kernel takes sources (8): staging, with the reason
    dist.init_process_group("mooncake", rank=0, world_size=9, init_method="file://" + os.path.join(d, "s9"),
                            pg_options=mooncake_pg.MooncakeOptions(active_ranks=[0]))
    r["cuda_path_9_seats"] = mooncake_pg.cuda_path()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(r))
''')


def cuda_build_paths():
    """(python of the CUDA venv, built .so) from scripts/build_cuda.sh's default places, or None."""
    cache = os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mooncake"
    )
    ver = os.environ.get("MOONCAKE_CUDA_TORCH", "2.14.1")
    py = os.path.join(
        os.environ.get("MOONCAKE_CUDA_VENV") or os.path.join(cache, f"cuda-venv-torch{ver}"),
        "bin",
        "python",
    )
    build = os.environ.get("MOONCAKE_CUDA_BUILD") or os.path.join(cache, f"cuda-build-torch{ver}")
    sos = glob.glob(os.path.join(build, "lib", "mooncake_pg", "_C*.so"))
    return (py, sos[0]) if os.path.exists(py) and sos else None


def run_cuda_build_smoke(py, so, workdir):
    """Imports the CUDA-built extension next to a copy of the Python package (the source
    tree's _C is the CPU build) and runs CUDA_BUILD_SMOKE; returns its RESULT."""
    pkg = os.path.join(workdir, "mooncake_pg")
    shutil.copytree(
        os.path.join(REPO, "mooncake_pg"),
        pkg,
        ignore=shutil.ignore_patterns("_C*.so", "__pycache__", "_build_info.py"),
    )
    shutil.copy2(so, pkg)
    ver = subprocess.run(
        [py, "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.strip()
    with open(os.path.join(pkg, "_build_info.py"), "w") as f:
        f.write(f"TORCH_VERSION = {ver!r}\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=workdir, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(
        [py, "-c", CUDA_BUILD_SMOKE],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])


def test_cuda_build_runs_without_a_gpu(tmp_path):
    """The CUDA build (torch 2.14.1 CUDA) imports here, registers "cuda", answers argument
    checks of its CUDA helpers with ValueError and runs CPU ops."""
    paths = cuda_build_paths()
    if paths is None:
        pytest.skip("no CUDA build of the extension on this machine (run scripts/build_cuda.sh)")
    r = run_cuda_build_smoke(*paths, str(tmp_path))
    assert r["WITH_CUDA"] and not r["cuda_available"]
    assert "cuda" in r["devices"]
    assert "expected CUDA tensors" in r["reduce_check"]
    assert "expected a CUDA tensor" in r["ipc_check"]
    assert r["cpu_all_reduce"]
    assert r["one_backend"]
    assert r["cuda_path"] == "ipc", r
    assert r["cuda_path_off"].startswith("staging: CUDA IPC switched off (MOONCAKE_CUDA_IPC=0"), r
    assert r["cuda_path_9_seats"].startswith("staging: max_group_size 9 exceeds the 8 sources"), r
    syms = subprocess.run(["nm", "-C", paths[1]], capture_output=True, text=True, timeout=60).stdout
    for want in (
        "mooncake::CudaIpc::stage",
        "mooncake::CudaIpc::reduce",
        "mooncake::cuda::ipc_event_open",
    ):
        assert want in syms, want


def test_gpu_checks_dry_run(tmp_path):
    """tests/device/run_gpu_checks.sh --dry-run plans every step and exits 0 without a GPU."""
    out = tmp_path / "gpu.json"
    p = subprocess.run(
        [
            "bash",
            os.path.join(REPO, "tests/device/run_gpu_checks.sh"),
            "--dry-run",
            "--json",
            str(out),
        ],
        cwd=REPO,
        env=_env(PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert r["dry_run"] is True and r["ok"] is True
    assert [s["step"] for s in r["plan"]["steps"]] == [
        "env",
        "build",
        "kernels",
        "conformance",
        "ep",
        "ep_nvshmem",
        "allreduce_bw",
    ]
    assert (
        sum(s["limit_s"] for s in r["plan"]["steps"]) <= 6 * 60 + 150
    )  # steps share a 340 s deadline
    bad = subprocess.run(
        ["bash", os.path.join(REPO, "tests/device/run_gpu_checks.sh"), "--steps", "nope"],
        cwd=REPO,
        env=_env(PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "unknown step" in bad.stderr


GPU = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a GPU (torch.cuda.is_available() is False); "
    "tests/device/run_gpu_checks.sh runs these paths on a GPU machine",
)


@GPU
@pytest.mark.skipif(not mooncake_pg.WITH_CUDA, reason="the extension was built without CUDA")
def test_cuda_reduce_kernel_sum():
    a, b = torch.arange(10, device="cuda", dtype=torch.float32), torch.ones(10, device="cuda")
    _C._cuda_reduce(a, [b], 0)
    assert torch.equal(a.cpu(), torch.arange(10, dtype=torch.float32) + 1)


@GPU
@pytest.mark.skipif(not mooncake_pg.WITH_CUDA, reason="the extension was built without CUDA")
def test_cuda_work_wait_orders_the_current_stream(tmp_path):
    """all_reduce on a CUDA tensor after a kernel on the current stream sees its result;
    Work.wait() makes the current stream wait for the copy back."""
    import torch.distributed as dist

    dist.init_process_group(
        "mooncake", rank=0, world_size=1, init_method="file://" + str(tmp_path / "s")
    )
    try:
        x = torch.zeros(1 << 20, device="cuda")
        x.add_(3)  # queued on the current stream
        w = dist.all_reduce(x, async_op=True)
        w.wait()
        assert float(x.sum()) == 3 * (1 << 20)
    finally:
        dist.destroy_process_group()


UNLISTED = '''
import triton
import triton.language as tl


@triton.jit
def _helper(x):
    return x + 1


@triton.jit
def _listed_kernel(p, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(p + o, _helper(tl.load(p + o)))


@triton.jit
def _forgotten_kernel(p, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(p + o, tl.load(p + o) * 2)


AOT_SIGNATURES = {"listed": (_listed_kernel, {"p": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": 16})}
'''


def test_triton_aot_names_an_unlisted_kernel(tmp_path):
    """scripts/triton_aot.py compiles the listed kernels for sm_90, counts called helpers
    as covered and fails naming a @triton.jit kernel missing from AOT_SIGNATURES."""
    pytest.importorskip("triton")
    (tmp_path / "fake_kernels.py").write_text(UNLISTED)
    out = tmp_path / "aot.json"
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "scripts/triton_aot.py"),
            "--module",
            "fake_kernels",
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert r["missing"] == ["_forgotten_kernel"] and r["helpers"] == ["_helper"]
    assert r["kernels"]["listed"]["ok"] and r["kernels"]["listed"]["cubin_bytes"] > 0
    assert "MISSING: @triton.jit _forgotten_kernel" in p.stdout


def _dev(name, *ports):
    return {"name": name, "ports": [{"port": i + 1, "state": st} for i, st in enumerate(ports)]}


@pytest.mark.skipif(not mooncake_pg.WITH_RDMA, reason="built without the RDMA transport")
def test_rdma_port_choice():
    """The port transport='rdma' uses: the first active one, or the one MOONCAKE_RDMA_DEVICE
    names; otherwise an error naming what was expected and every port found."""
    devs = [_dev("mlx5_0", "PORT_DOWN", "PORT_ACTIVE"), _dev("mlx5_1", "PORT_ACTIVE")]
    assert _C._rdma_choose(devs, "") == ("mlx5_0", 2)
    assert _C._rdma_choose(devs, "mlx5_1") == ("mlx5_1", 1)
    assert _C._rdma_choose(devs, "mlx5_0:2") == ("mlx5_0", 2)
    with pytest.raises(
        RuntimeError,
        match=r"expected an RDMA device port in state PORT_ACTIVE matching 'mlx5_0:1', "
        r"got 2 device\(s\) \[mlx5_0:1 PORT_DOWN, mlx5_0:2 PORT_ACTIVE, "
        r"mlx5_1:1 PORT_ACTIVE\]",
    ):
        _C._rdma_choose(devs, "mlx5_0:1")
    with pytest.raises(RuntimeError, match=r"got 0 device\(s\)"):
        _C._rdma_choose([], "")
    with pytest.raises(RuntimeError, match="expected DEVICE\\[:PORT\\]"):
        _C._rdma_choose(devs, "mlx5_0:x")


@pytest.mark.skipif(not mooncake_pg.WITH_RDMA, reason="built without the RDMA transport")
def test_rdma_qp_info_codec():
    """Queue pair info travels through the store as text; malformed text raises."""
    s = "4660 1193046 7 5 fe800000000000000000000000000001"
    assert _C._rdma_qp_info_roundtrip(s) == s
    for bad in ("", "1 2 3", "1 2 3 4 fe80"):
        with pytest.raises(RuntimeError, match="RdmaQpInfo::decode: malformed queue pair info"):
            _C._rdma_qp_info_roundtrip(bad)
