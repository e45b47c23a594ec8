"""Build of the one extension module, ``mooncake_pg._C``.

Use ``pip install --no-build-isolation -e .`` so the extension compiles against the
torch that is already installed (see pyproject.toml).
"""
import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

os.environ.setdefault("MAX_JOBS", "2")
HERE = os.path.dirname(os.path.abspath(__file__))

# The torch version the extension is compiled against; checked again at import time.
with open(os.path.join(HERE, "mooncake_pg", "_build_info.py"), "w") as f:
    f.write(f"TORCH_VERSION = {torch.__version__!r}\n")

sources = sorted(
    glob.glob("csrc/transport/*.cpp") + glob.glob("csrc/pg/*.cpp") + glob.glob("csrc/ep/*.cpp")
) + ["csrc/bindings.cpp"]

ext = CppExtension(
    name="mooncake_pg._C",
    sources=sources,
    include_dirs=[os.path.join(HERE, "csrc")],
    extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden", "-fwrapv",
                        f'-DMOONCAKE_TORCH_VERSION="{torch.__version__}"'],
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
