"""Build of the one extension module, ``mooncake_pg._C``.

Use ``pip install --no-build-isolation -e .`` so the extension compiles against the
torch that is already installed (see pyproject.toml).

Optional parts (each adds a ``-DMOONCAKE_WITH_*`` define):

- RDMA (``csrc/transport/rdma/``, ``-libverbs``): built when ``infiniband/verbs.h`` exists
  (Debian ``libibverbs-dev``); ``MOONCAKE_WITH_RDMA=0`` turns it off, ``=1`` makes a
  missing header an error.
- CUDA (``csrc/transport/cuda/`` and the process group's CUDA paths, ``csrc/pg/cuda/``):
  a ``CUDAExtension`` when ``MOONCAKE_WITH_CUDA=1`` (needs a CUDA build of torch and nvcc;
  ``CUDA_HOME`` and ``TORCH_CUDA_ARCH_LIST`` as torch reads them). The default build is
  CPU-only.
"""

import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

os.environ.setdefault("MAX_JOBS", "2")
HERE = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    raw = os.environ.get(name, "")
    return None if raw == "" else raw not in ("0", "false", "False", "no")


def _verbs_header():
    dirs = ["/usr/include", "/usr/local/include"] + [
        d for d in os.environ.get("CPATH", "").split(":") if d
    ]
    return any(os.path.exists(os.path.join(d, "infiniband", "verbs.h")) for d in dirs)


with_rdma = _flag("MOONCAKE_WITH_RDMA")
if with_rdma is None:
    with_rdma = _verbs_header()
elif with_rdma and not _verbs_header():
    raise SystemExit(
        "setup.py: MOONCAKE_WITH_RDMA=1 needs infiniband/verbs.h: install libibverbs-dev"
    )
with_cuda = bool(_flag("MOONCAKE_WITH_CUDA"))
if with_cuda and not torch.version.cuda:
    raise SystemExit(
        f"setup.py: MOONCAKE_WITH_CUDA=1 needs a CUDA build of torch, got torch {torch.__version__} "
        "(torch.version.cuda is None)"
    )

# The torch version the extension is compiled against and the optional parts built in;
# checked again at import time.
# (MOONCAKE_BUILD_INFO_DIR: somewhere else, for a build outside the tree such as
# scripts/build_cuda.sh, so the in-tree extension's record stays as it is)
info_dir = os.environ.get("MOONCAKE_BUILD_INFO_DIR") or os.path.join(HERE, "mooncake_pg")
os.makedirs(info_dir, exist_ok=True)
with open(os.path.join(info_dir, "_build_info.py"), "w") as f:
    f.write(f"TORCH_VERSION = {torch.__version__!r}\n")

# The sources of each part (globs). scripts/check_includes.py reads this literal too, to
# count the translation units of the CPU build that include torch headers.
SOURCES = {
    "cpu": [
        "csrc/transport/*.cpp",
        "csrc/core/*.cpp",
        "csrc/core/collectives/*.cpp",
        "csrc/pg/*.cpp",
        "csrc/ep/*.cpp",
        "csrc/bindings/*.cpp",
    ],
    "rdma": ["csrc/transport/rdma/*.cpp"],
    "cuda": ["csrc/transport/cuda/*.cpp", "csrc/transport/cuda/*.cu", "csrc/pg/cuda/*.cpp"],
}


def _sources(part):
    return sorted(f for g in SOURCES[part] for f in glob.glob(g))


sources = _sources("cpu")
defines = [f'-DMOONCAKE_TORCH_VERSION="{torch.__version__}"']
libraries = []
if with_rdma:
    sources += _sources("rdma")
    defines.append("-DMOONCAKE_WITH_RDMA")
    libraries.append("ibverbs")


def _cxx_std():
    """C++17, or C++20 where torch's headers demand it (torch 2.14 does)."""
    from torch.utils.cpp_extension import include_paths

    for d in include_paths():
        try:
            with open(os.path.join(d, "ATen", "ATen.h")) as f:
                if "C++20 or later" in f.read():
                    return "c++20"
        except OSError:
            continue
    return "c++17"


std = _cxx_std()
cxx_flags = ["-O3", f"-std={std}", "-fvisibility=hidden", "-fwrapv"]
kwargs = dict(name="mooncake_pg._C", include_dirs=[os.path.join(HERE, "csrc")], libraries=libraries)
if with_cuda:
    sources += _sources("cuda")
    defines.append("-DMOONCAKE_WITH_CUDA")
    ext = CUDAExtension(
        sources=sources,
        extra_compile_args={
            "cxx": cxx_flags + defines,
            "nvcc": ["-O3", f"-std={std}", "--expt-relaxed-constexpr"] + defines,
        },
        **kwargs,
    )
else:
    ext = CppExtension(sources=sources, extra_compile_args=cxx_flags + defines, **kwargs)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
