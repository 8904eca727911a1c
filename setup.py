"""Ahead-of-time build of shardopt and its extension shardopt._C.

    pip install --no-build-isolation .      # needs torch already installed

Without a prebuilt module, ``import shardopt`` builds the same sources just in time.
"""

import importlib.util
from pathlib import Path

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_build", ROOT / "shardopt" / "_build.py")
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)

with_cuda = _build.want_cuda()
Extension = CUDAExtension if with_cuda else CppExtension
ext = Extension(
    name="shardopt._C",
    sources=[str(Path(s).relative_to(ROOT)) for s in _build.sources(with_cuda)],
    extra_compile_args=_build.compile_args(with_cuda),
    extra_link_args=_build.LINK_ARGS,
)

setup(
    packages=find_packages(include=["shardopt", "shardopt.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
