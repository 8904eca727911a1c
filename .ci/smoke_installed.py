"""Packaging smoke test: run by .ci/dist-check with the Python of a clean venv that has torch and
the shardopt wheel installed, from a folder outside the source tree.

    python .ci/smoke_installed.py --sdist DIST.tar.gz --wheel DIST.whl [--jit]

Checks what the sdist and the wheel hold, then that the installed package imports from the venv,
loads its prebuilt modules (the CPU ISA module chosen for this CPU), matches torch.optim.AdamW with
every ISA module this CPU runs, and answers ``python -m shardopt.checkpoint --version``. ``--jit``
also builds the extension just in time from the sources shipped inside the installed package.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import torch

CPU_SUFFIXES = (".h", ".cpp", ".cu", ".cuh")
PASSED = [0]


def check(cond: bool, what: str) -> None:
    if not cond:
        print(f"dist-check FAILED: {what}")
        raise SystemExit(f"dist-check: {PASSED[0]} passed, 1 failed")
    PASSED[0] += 1
    print(f"  ok  {what}")


def check_sdist(path: Path) -> None:
    print(f"sdist {path.name} ({path.stat().st_size / 1e3:.0f} kB)")
    with tarfile.open(path) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        pkg_info = tar.extractfile(next(n for n in tar.getnames() if n.endswith("/PKG-INFO")))
        meta = pkg_info.read().decode()
    csrc = {n for n in names if n.startswith("csrc/") and n.endswith(CPU_SUFFIXES)}
    for kind in (".h", ".cpp", ".cu", ".cuh"):
        check(any(n.endswith(kind) for n in csrc), f"sdist holds csrc/**/*{kind}")
    check("csrc/kernels.h" in names and "csrc/bindings.cpp" in names, "sdist holds csrc/kernels.h")
    for name in ("LICENSE", "README.md", "setup.py", "pyproject.toml", "shardopt/kernels/build.py"):
        check(name in names, f"sdist holds {name}")
    check(not any(n.endswith((".so", ".o")) for n in names), "sdist holds no binaries")
    check("Requires-Dist: torch>=2.4" in meta, "sdist requires a torch range (torch>=2.4)")


def check_wheel(path: Path, sdist: Path) -> None:
    print(f"wheel {path.name} ({path.stat().st_size / 1e6:.2f} MB)")
    with zipfile.ZipFile(path) as whl:
        infos = {i.filename: i for i in whl.infolist()}
        meta = whl.read(next(n for n in infos if n.endswith(".dist-info/METADATA"))).decode()
    with tarfile.open(sdist) as tar:
        csrc = {
            n.split("/", 1)[1] for n in tar.getnames() if "/csrc/" in n and n.endswith(CPU_SUFFIXES)
        }
    shipped = {n.replace("shardopt/_csrc/", "csrc/", 1) for n in infos if "/_csrc/" in n}
    check(csrc <= shipped, f"wheel ships all {len(csrc)} csrc/ files as shardopt/_csrc/")
    for name in ("shardopt/py.typed", "shardopt/_build_info.json"):
        check(name in infos, f"wheel holds {name}")
    check(any(n.endswith(".dist-info/licenses/LICENSE") for n in infos), "wheel holds LICENSE")
    torch_pin = "torch==" + torch.__version__.split("+")[0]
    check(f"Requires-Dist: {torch_pin}" in meta, f"wheel requires {torch_pin}")
    for name, info in sorted(infos.items()):
        if name.endswith(".so"):
            mb = info.file_size / 1e6
            print(f"      {name}: {mb:.2f} MB")
            check(mb < 8, f"{name} has no debug info (< 8 MB)")


def adam_matches_torch() -> None:
    torch.manual_seed(0)
    import shardopt

    params = [torch.randn(70_001), torch.randn(3, 5), torch.randn(1)]
    ref = [p.clone() for p in params]
    opt = shardopt.FusedAdam(params, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        for p, r in zip(params, ref):
            p.grad = torch.randn_like(p)
            r.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=1.3e-6, atol=1e-5)


def check_installed() -> None:
    import shardopt
    from shardopt.kernels import build, cpu_isa, loader

    where = Path(shardopt.__file__).resolve()
    print(f"installed {where.parent}")
    check(Path(sys.prefix).resolve() in where.parents, "shardopt imports from the venv")
    version = importlib.metadata.version("shardopt")
    check(shardopt.__version__ == version, f"__version__ == metadata version ({version})")
    print("  " + loader.describe().replace("\n", "\n  "))
    check(loader.extension().__name__ == "shardopt._C", "the prebuilt shardopt._C loads (no JIT)")
    cap = cpu_isa.detect_cpu_capability()
    levels = {c: m for c, m, _ in build.cpu_isa_levels()}
    expected = f"shardopt.{levels.get(cap, '_C')}"
    check(loader.cpu_extension().__name__ == expected, f"CPU kernels from {expected} ({cap} CPU)")
    for c, module, _ in build.cpu_isa_levels():
        if cpu_isa.CAPABILITIES.index(c) > cpu_isa.CAPABILITIES.index(cap):
            continue
        loader._CPU = loader.extension() if module == "_C" else loader._import_prebuilt(module)
        adam_matches_torch()
        check(True, f"FusedAdam == torch.optim.AdamW (3 steps) with shardopt.{module}")
    loader._CPU = None
    out = subprocess.run(
        [sys.executable, "-m", "shardopt.checkpoint", "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    check(out == f"shardopt {version}", f"python -m shardopt.checkpoint --version: {out!r}")
    if shutil.which("objdump"):
        for so in sorted(where.parent.glob("_C*.so")):
            dis = subprocess.run(["objdump", "-d", str(so)], capture_output=True, text=True).stdout
            zmm = sum("zmm" in line for line in dis.splitlines())
            print(f"      {so.name}: {zmm} instructions with zmm registers")
            if "avx512" not in so.name:
                check(zmm == 0, f"{so.name} holds no AVX-512 (zmm) instructions")


def check_jit() -> None:
    """The JIT build from the sources shipped in the installed package (not a checkout)."""
    with tempfile.TemporaryDirectory() as build_dir:
        env = dict(os.environ, SHARDOPT_FORCE_JIT="1", SHARDOPT_BUILD_DIR=build_dir)
        code = (
            "import shardopt, shardopt.kernels.build as b; from shardopt.kernels import loader; "
            "print(loader.extension().__file__); print(b.CSRC)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        check(out[0].startswith(build_dir), f"JIT build in SHARDOPT_BUILD_DIR: {out[0]}")
        check(Path(out[1]).resolve().parts[-2:] == ("shardopt", "_csrc"), f"JIT sources: {out[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, required=True)
    parser.add_argument("--wheel", type=Path, required=True)
    parser.add_argument("--jit", action="store_true", help="also build just in time (~1-2 min)")
    args = parser.parse_args()
    check_sdist(args.sdist)
    check_wheel(args.wheel, args.sdist)
    check_installed()
    if args.jit:
        check_jit()
    print(f"dist-check: {PASSED[0]} passed, 0 failed")


if __name__ == "__main__":
    main()
