"""The extension's load-time checks, its type stub, and what the shared-memory transport
leaves behind."""

import ast
import os
import subprocess
import sys

import pytest

from tests import REPO_ROOT, rankpool

REPO = REPO_ROOT


def test_refuses_other_torch_version():
    """``_C`` built for one torch refuses to load under another, naming both versions."""
    code = (
        "import torch\n"
        "built = torch.__version__\n"
        "torch.__version__ = '9.9.9'\n"
        "try:\n"
        "    import mooncake_pg\n"
        "except ImportError as e:\n"
        "    msg = str(e)\n"
        "    assert '9.9.9' in msg and built in msg, msg\n"
        "    print('refused:', msg)\n"
        "else:\n"
        "    raise SystemExit('mooncake_pg loaded under a different torch version')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "refused:" in out.stdout


def _stub_names():
    """{name: set of member names} of the top level of mooncake_pg/_C.pyi (None for a
    function or a constant)."""
    with open(os.path.join(REPO, "mooncake_pg", "_C.pyi")) as f:
        tree = ast.parse(f.read())

    def name_of(node):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            return node.name
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return node.target.id
        return None

    out = {}
    for node in tree.body:
        name = name_of(node)
        if name is None:
            continue
        out[name] = (
            {n for n in map(name_of, node.body) if n} if isinstance(node, ast.ClassDef) else None
        )
    return out


def test_type_stub_matches_the_module():
    """mooncake_pg/_C.pyi names exactly what _C exports: its public names equal the
    module's, every private name the module has is in the stub, and each class lists the
    public methods and attributes the class defines."""
    from mooncake_pg import _C

    stub = _stub_names()
    public = {n for n in dir(_C) if not n.startswith("_")}
    stub_public = {n for n in stub if not n.startswith("_")}
    assert stub_public == public, (
        f"only in the stub: {sorted(stub_public - public)}, only in _C: {sorted(public - stub_public)}"
    )
    private = {n for n in dir(_C) if n.startswith("_") and not n.startswith("__")}
    assert private <= set(stub), sorted(private - set(stub))
    for name, members in stub.items():
        if members is None:
            continue
        cls = getattr(_C, name)
        defined = {n for n in vars(cls) if not n.startswith("__") and n != "_pybind11_conduit_v1_"}
        listed = {m for m in members if m != "__init__"}
        assert listed == defined, (
            f"{name}: only in the stub: {sorted(listed - defined)}, only in _C: {sorted(defined - listed)}"
        )


def _shm_names(rank, world_size):
    import mooncake_pg

    return mooncake_pg.backend_of().transport, sorted(
        n for n in os.listdir("/dev/shm") if n.startswith("mooncake-")
    )


def test_shm_segments_unlinked_once_mapped():
    """After set-up every rank has the segment mapped and its name is gone from /dev/shm,
    so a SIGKILL of any rank cannot leak it."""
    if rankpool.default_backend()[0] != "mooncake":
        pytest.skip("mooncake-specific")
    res = rankpool.get_pool(3, "mooncake", "shm").run(_shm_names, timeout=60)
    for transport, names in res:
        assert transport == "shm"
        assert names == [], names


def _transport(rank, world_size):
    import mooncake_pg

    return mooncake_pg.backend_of().transport


def test_forced_tcp_transport_is_used():
    if rankpool.default_backend()[0] != "mooncake":
        pytest.skip("mooncake-specific")
    assert rankpool.get_pool(2, "mooncake", "tcp").run(_transport, timeout=60) == ["tcp", "tcp"]
