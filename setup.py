"""Ahead-of-time build of shardopt and its extension modules (needs torch already installed).

    pip install --no-build-isolation -e .                 # a checkout (what `make setup` runs)
    python -m build --sdist --no-isolation                # a complete source distribution
    pip wheel --no-build-isolation --no-deps shardopt-*.tar.gz   # a wheel, from the sdist

Modules (see Note: CPU capability dispatch in docs/design.md; sources and flags in
shardopt/kernels/build.py): ``shardopt._C`` (baseline CPU
kernels, plus the CUDA kernels when torch has CUDA and nvcc is found) and, on x86-64,
``shardopt._C_avx2`` and ``shardopt._C_avx512`` (the CPU kernels for those ISA levels). All are
release builds (no debug info). ``SHARDOPT_BUILD_EXT=0`` builds none: a pure-Python install whose
first kernel use builds one module for that machine just in time.

A wheel requires the torch it was built against (``torch==X.Y.Z``): torch's C++ ABI changes between
releases. The sdist keeps the range below. build_py copies ``csrc/`` into the package
(``shardopt/_csrc``) so that installs carry the sources of the JIT build.
"""

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
# shardopt/kernels/build.py imports nothing of shardopt, so it runs before the package is built
_spec = importlib.util.spec_from_file_location(
    "shardopt_build", ROOT / "shardopt" / "kernels" / "build.py"
)
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)

TORCH_RANGE = "torch>=2.4"  # what the sources build against (the sdist's requirement)
TORCH_BUILT = "torch==" + torch.__version__.split("+")[0]  # what a binary runs with
OTHER_REQUIRES = ["ninja", "numpy"]

with_ext = os.environ.get("SHARDOPT_BUILD_EXT", "1") != "0"
with_cuda = with_ext and _build.want_cuda()


def extensions() -> list:
    """One module per CPU ISA level; the baseline ``_C`` also holds the CUDA kernels."""
    exts = []
    for _capability, module, cpu_flags in _build.cpu_isa_levels():
        cuda = with_cuda and module == "_C"
        flags = _build.compile_args(cuda, cpu_flags)
        flags["cxx"] += _build.RELEASE_COMPILE_ARGS
        Extension = CUDAExtension if cuda else CppExtension
        exts.append(
            Extension(
                name=f"shardopt.{module}",
                sources=[str(Path(s).relative_to(ROOT)) for s in _build.sources(cuda, CSRC)],
                extra_compile_args=flags,
                extra_link_args=_build.LINK_ARGS + _build.RELEASE_LINK_ARGS,
            )
        )
    return exts


class BuildPy(build_py):
    """Also copies csrc/ into the built package as shardopt/_csrc (the JIT build's sources)."""

    def run(self):
        super().run()
        if self.editable_mode:  # an editable install reads the checkout's csrc/
            return
        dest = Path(self.build_lib) / "shardopt" / "_csrc"
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(
            CSRC, dest, ignore=shutil.ignore_patterns("*.o", "*.so", "__pycache__", ".*")
        )


class BuildExt(BuildExtension):
    """torch's BuildExtension (ninja) with one build folder per module (the ISA modules compile the
    same sources with other flags) and a record of the torch the modules are built against."""

    def build_extension(self, ext):
        build_temp = self.build_temp
        self.build_temp = os.path.join(build_temp, ext.name)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = build_temp

    def run(self):
        super().run()
        info = {
            "torch": torch.__version__,
            "cuda": torch.version.cuda if with_cuda else None,
            "modules": [ext.name for ext in self.extensions],
        }
        dirs = [Path(self.build_lib) / "shardopt"]
        if self.inplace:  # --inplace and editable installs: next to the copied modules
            dirs.append(Path(self.get_finalized_command("build_py").get_package_dir("shardopt")))
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            (d / _build.BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n")


# A binary pins the torch it was built against; the sdist (and a build with no binary) keeps the
# range. PEP 517's build_sdist runs this file with "sdist" in argv.
binary = with_ext and "sdist" not in sys.argv[1:]

setup(
    packages=find_packages(include=["shardopt", "shardopt.*"]),
    ext_modules=extensions() if with_ext else [],
    install_requires=[TORCH_BUILT if binary else TORCH_RANGE] + OTHER_REQUIRES,
    cmdclass={
        "build_py": BuildPy,
        "build_ext": BuildExt.with_options(use_ninja=True),
    },
)
