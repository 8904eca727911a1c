"""Packaging: the CPU ISA modules (flags, dispatch, numerics), load-time checks, JIT UX, version.

The wheel itself (sdist -> wheel -> clean venv) is checked by `make dist-check` (.ci/dist-check).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardopt
from shardopt.kernels import build, cpu_isa, jit, loader

PACKAGE = Path(shardopt.__file__).resolve().parent
X86_LEVELS = {c: m for c, m, _ in build.cpu_isa_levels()} if build._is_x86() else {}


def _built_module(module: str) -> Path:
    found = sorted(PACKAGE.glob(f"{module}.*.so"))
    if not found:
        pytest.skip(f"shardopt.{module} is not built (JIT-only checkout)")
    return found[0]


@pytest.mark.skipif(not X86_LEVELS, reason="x86-64 ISA modules only")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
@pytest.mark.parametrize(
    "capability, zmm, ymm",
    [("default", False, False), ("avx2", False, True), ("avx512", True, True)],
)
def test_isa_module_holds_only_its_instructions(capability, zmm, ymm):
    """The baseline runs on any x86-64-v2 CPU (no AVX), the AVX2 one on any AVX2 CPU (no zmm)."""
    so = _built_module(X86_LEVELS[capability])
    dis = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True, text=True, check=True
    ).stdout
    assert ("zmm" in dis) == zmm, f"{so.name}: {dis.count('zmm')} zmm (AVX-512) operands"
    assert ("ymm" in dis) == ymm, f"{so.name}: {dis.count('ymm')} ymm (AVX) operands"
    assert so.stat().st_size < 8e6, f"{so.name} is {so.stat().st_size / 1e6:.1f} MB: debug info?"


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_each_isa_module_matches_torch_adamw(monkeypatch, capability):
    if loader.extension().__name__ != "shardopt._C":
        pytest.skip("JIT build: one module")
    detected = cpu_isa.detect_cpu_capability()
    if capability not in X86_LEVELS and capability != "default":
        pytest.skip("x86-64 ISA modules only")
    if cpu_isa.CAPABILITIES.index(capability) > cpu_isa.CAPABILITIES.index(detected):
        pytest.skip(f"this CPU runs up to {detected}")
    monkeypatch.setenv("SHARDOPT_CPU_CAPABILITY", capability)
    module = loader.load_cpu_extension(loader.extension())
    expected = "shardopt." + (X86_LEVELS.get(capability) or "_C")
    assert module.__name__ == expected
    monkeypatch.setattr(loader, "_CPU", module)
    torch.manual_seed(0)
    params = [torch.randn(loader.chunk_size("cpu") + 5), torch.randn(7), torch.randn(1)]
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


def test_cpu_capability_from_cpuinfo_flags(monkeypatch):
    monkeypatch.setattr(build, "_is_x86", lambda: True)
    v2 = cpu_isa._X86_LEVEL_FLAGS["default"]
    v3 = v2 | cpu_isa._X86_LEVEL_FLAGS["avx2"]
    v4 = v3 | cpu_isa._X86_LEVEL_FLAGS["avx512"]
    assert cpu_isa.detect_cpu_capability(frozenset(v4 | {"avx512_bf16"})) == "avx512"
    assert cpu_isa.detect_cpu_capability(frozenset(v3)) == "avx2"
    assert cpu_isa.detect_cpu_capability(frozenset(v3 - {"fma"})) == "default"
    # AVX-512 flags without AVX2 (never seen, but the levels are cumulative)
    assert cpu_isa.detect_cpu_capability(frozenset(v2 | cpu_isa._X86_LEVEL_FLAGS["avx512"])) == (
        "default"
    )
    assert cpu_isa.detect_cpu_capability(frozenset({"sse2", "cx16"})) is None
    monkeypatch.setattr(cpu_isa, "detect_cpu_capability", lambda flags=None: None)
    with pytest.raises(RuntimeError, match="x86-64-v2"):
        cpu_isa.cpu_capability()


def test_cpu_capability_override(monkeypatch):
    monkeypatch.setattr(cpu_isa, "detect_cpu_capability", lambda flags=None: "avx2")
    monkeypatch.setenv("SHARDOPT_CPU_CAPABILITY", "default")
    assert cpu_isa.cpu_capability() == "default"
    monkeypatch.setenv("SHARDOPT_CPU_CAPABILITY", "AVX512")
    with pytest.raises(RuntimeError, match="supports up to avx2.*illegal instruction"):
        cpu_isa.cpu_capability()
    monkeypatch.setenv("SHARDOPT_CPU_CAPABILITY", "sse9")
    with pytest.raises(RuntimeError, match="expected one of default, avx2, avx512"):
        cpu_isa.cpu_capability()
    monkeypatch.delenv("SHARDOPT_CPU_CAPABILITY")
    assert cpu_isa.cpu_capability() == "avx2"


def _python_m_shardopt(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardopt"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


@pytest.mark.parametrize(
    "env, message",
    [
        ({"SHARDOPT_CPU_CAPABILITY": "sse9"}, "SHARDOPT_CPU_CAPABILITY='sse9': expected one of"),
        (
            {"SHARDOPT_CPU_CAPABILITY": "avx2", "SHARDOPT_SIMULATE_CPU_LEVEL": "default"},
            "SHARDOPT_CPU_CAPABILITY=avx2 but this CPU supports up to default",
        ),
    ],
)
def test_python_m_shardopt_bad_capability_is_one_line(env, message):
    """``python -m shardopt`` with a bad SHARDOPT_CPU_CAPABILITY: one ``error: ...`` line on
    stderr naming it and a non-zero exit, no traceback; a good one prints the modules."""
    if not build._is_x86() and "SHARDOPT_SIMULATE_CPU_LEVEL" in env:
        pytest.skip("x86-64 levels only")
    out = _python_m_shardopt(env)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stdout == ""
    assert out.stderr.startswith("error: ") and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    good = _python_m_shardopt({"SHARDOPT_CPU_CAPABILITY": "default"})
    assert good.returncode == 0 and "CPU kernels: shardopt._C " in good.stdout, good.stderr


def test_a_module_built_for_another_torch_names_the_mismatch():
    running = torch.__version__
    with pytest.raises(
        ImportError, match=rf"built against torch 2\.0\.1, but torch {re.escape(running)}"
    ):
        loader.check_build_info({"torch": "2.0.1", "cuda": None})
    with pytest.raises(ImportError, match="rebuild shardopt against.*SHARDOPT_FORCE_JIT=1"):
        loader.check_build_info({"torch": "2.0.1"})
    # the same release with another local tag (+cpu, +cu128) keeps the C++ ABI
    loader.check_build_info({"torch": running.split("+")[0] + "+other", "cuda": None})
    loader.check_build_info(None)
    if torch.version.cuda is None:
        with pytest.raises(ImportError, match="has CUDA kernels.*has no CUDA"):
            loader.check_build_info({"torch": running, "cuda": "12.8"})


def test_jit_without_a_compiler_is_one_actionable_line(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("SHARDOPT_BUILD_DIR", str(tmp_path))
    with pytest.raises(RuntimeError) as err:
        jit.jit_build()
    msg = str(err.value)
    assert "\n" not in msg and "no C++ compiler" in msg and "install g++" in msg
    assert err.value.__cause__ is None and err.value.__context__ is None


def test_jit_build_failure_is_one_line_with_the_log(monkeypatch, tmp_path):
    """A compile error: the first error line and where the full log is, not ninja's dump."""
    fake = tmp_path / "c++"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$*" in *" -c "*) echo "adam_cpu.cpp:3:10: fatal error: x.h: No such file" >&2; '
        "exit 1;; esac\n"
        'exec g++ "$@"\n'
    )
    fake.chmod(0o755)
    if shutil.which("g++") is None:
        pytest.skip("needs g++ for the fake compiler's --version")
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("SHARDOPT_BUILD_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SHARDOPT_CPU_MARCH", "x86-64" if build._is_x86() else "")
    with pytest.raises(RuntimeError) as err:
        jit.jit_build()
    msg = str(err.value)
    assert "\n" not in msg and "fatal error: x.h: No such file" in msg, msg
    log = Path(msg.split("full log: ")[1].split(";")[0])
    assert log.is_file() and "fatal error" in log.read_text()


def test_jit_build_logs_once_per_node(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert jit._log_this_process()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert jit._log_this_process()
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert not jit._log_this_process()


def test_jit_cache_key_includes_the_cpu(monkeypatch):
    flags = build.compile_args(False)
    monkeypatch.setattr(build, "_is_x86", lambda: True)
    monkeypatch.setattr(cpu_isa, "detect_cpu_capability", lambda flags=None: "avx512")
    a = jit.jit_build_dir(False, flags)
    monkeypatch.setattr(cpu_isa, "detect_cpu_capability", lambda flags=None: "avx2")
    b = jit.jit_build_dir(False, flags)
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"avx2", "other"}))
    c = jit.jit_build_dir(False, flags)
    assert len({a, b, c}) == 3 and "-avx2-" in b.name


def test_jit_log_goes_to_the_shardopt_logger(monkeypatch, tmp_path, caplog):
    """The build message is a logging record of "shardopt" (shown by default as a warning)."""
    monkeypatch.setenv("CXX", sys.executable)  # found on PATH: gets past the compiler check
    monkeypatch.setenv("SHARDOPT_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr("torch.utils.cpp_extension.load", _raise_build_error)
    with caplog.at_level(logging.INFO, logger="shardopt"), pytest.raises(RuntimeError):
        jit.jit_build()
    records = [r for r in caplog.records if r.name == "shardopt"]
    assert len(records) == 1 and "just in time" in records[0].getMessage()
    assert str(tmp_path) in records[0].getMessage()


def _raise_build_error(**kwargs):
    raise RuntimeError("Error building extension 'shardopt_C'")


def test_sources_come_from_the_package_copy_first():
    shipped = PACKAGE / "_csrc"
    expected = shipped if (shipped / "bindings.cpp").is_file() else PACKAGE.parent / "csrc"
    assert build.CSRC == expected
    assert all(Path(s).is_file() for s in build.sources(False))


def test_version_is_single_sourced():
    from shardopt._version import __version__

    assert shardopt.__version__ == __version__
    out = subprocess.run(
        [sys.executable, "-m", "shardopt.checkpoint", "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == f"shardopt {__version__}"
    assert (PACKAGE / "py.typed").is_file()


# -- the ISA guard: a module built for a higher CPU level is an ImportError, never SIGILL ---------

LOWER = [("default", "avx2"), ("default", "avx512"), ("avx2", "avx512")]


def _runs(level: str) -> bool:
    """Whether this CPU runs the ISA modules of ``level`` (the check the modules make)."""
    from shardopt.kernels import cpu_isa

    detected = cpu_isa.detect_cpu_capability() or "default"
    return cpu_isa.CAPABILITIES.index(level) <= cpu_isa.CAPABILITIES.index(detected)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(not X86_LEVELS, reason="x86-64 ISA modules only")
@pytest.mark.parametrize("level, module_level", LOWER)
def test_importing_a_module_of_a_higher_cpu_level_is_an_import_error(level, module_level):
    """SHARDOPT_SIMULATE_CPU_LEVEL makes the modules' own check (Note: ISA guard in
    csrc/bindings.cpp) see a CPU of that level: the import raises, the interpreter lives on."""
    name = X86_LEVELS[module_level]
    _built_module(name)
    code = (
        "import importlib\n"
        "try:\n"
        f"    importlib.import_module('shardopt.{name}')\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
        "else:\n"
        "    print('imported')\n"
    )
    out = _python(code, SHARDOPT_SIMULATE_CPU_LEVEL=level)
    assert out.returncode == 0, f"exit {out.returncode} (a signal if negative): {out.stderr}"
    assert out.stdout.startswith("ImportError:"), out.stdout
    assert f"{name} is built for {module_level} CPUs and this CPU lacks" in out.stdout
    assert "import shardopt instead" in out.stdout
    # at its own level it imports, on a CPU that has that level (else the real check refuses)
    out = _python(code, SHARDOPT_SIMULATE_CPU_LEVEL=module_level)
    if _runs(module_level):
        assert out.returncode == 0 and out.stdout.strip() == "imported", out.stdout + out.stderr
    else:
        assert out.returncode == 0 and out.stdout.startswith("ImportError:"), out.stdout


@pytest.mark.skipif(not X86_LEVELS, reason="x86-64 ISA modules only")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
@pytest.mark.parametrize("capability", ["avx2", "avx512"])
def test_what_runs_before_the_isa_check_has_no_vector_instructions(capability):
    """The entry point, its CPU check and the static initializers (which run at dlopen, before
    it) hold no AVX instructions: only they run on a CPU below the module's level."""
    so = _built_module(X86_LEVELS[capability])
    dis = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "-C", str(so)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    functions = re.split(r"\n(?=[0-9a-f]+ <)", dis)
    early = [
        f
        for f in functions
        if re.match(r"[0-9a-f]+ <(PyInit_|_GLOBAL__sub_I|.*missing_cpu_feature)", f)
    ]
    assert any(f.split("<", 1)[1].startswith("PyInit_") for f in early), "no PyInit_ found"
    for f in early:
        head = f.split("\n", 1)[0]
        assert not re.search(r"[yz]mm|\bv[a-z]+\s", f), f"{so.name}: {head} uses AVX"


def test_walk_packages_imports_every_module():
    """What pkgutil.walk_packages users (pytest --doctest-modules, Sphinx autosummary, pdoc) do:
    import every shardopt module, in a fresh interpreter; at a simulated CPU level below the ISA
    modules only those refuse, with an ImportError, and the kernels still run (from a module
    this CPU has)."""
    code = (
        "import importlib, pkgutil, torch, shardopt\n"
        "for info in pkgutil.walk_packages(shardopt.__path__, 'shardopt.'):\n"
        "    try:\n"
        "        importlib.import_module(info.name)\n"
        "    except ImportError as e:\n"
        "        print('refused', info.name)\n"
        "    else:\n"
        "        print('imported', info.name)\n"
        "p, q = (torch.nn.Parameter(torch.linspace(-1, 1, 5)) for _ in range(2))\n"
        "p.grad = q.grad = torch.linspace(2, 3, 5)\n"
        "shardopt.FusedAdam([p], lr=0.1, weight_decay=0.0).step()\n"
        "torch.optim.Adam([q], lr=0.1).step()\n"
        "from shardopt.kernels import loader\n"
        "print('kernels', loader.cpu_extension().__name__, float((p - q).abs().max()))\n"
    )
    levels = ["default"] if X86_LEVELS else []
    for level in [None, *levels]:
        out = _python(code, **({"SHARDOPT_SIMULATE_CPU_LEVEL": level} if level else {}))
        assert out.returncode == 0, f"exit {out.returncode} at {level}: {out.stderr[-2000:]}"
        lines = out.stdout.splitlines()
        refused = {ln.split()[1] for ln in lines if ln.startswith("refused")}
        imported = {ln.split()[1] for ln in lines if ln.startswith("imported")}
        assert "shardopt.kernels.ops" in imported and "shardopt.zero.engine" in imported
        if level is None:  # only the modules above this CPU's level refuse
            above = {f"shardopt.{m}" for c, m in X86_LEVELS.items() if not _runs(c)}
            assert refused == above & (refused | imported), refused
        else:
            assert refused == {f"shardopt.{X86_LEVELS[c]}" for c in ("avx2", "avx512")} & (
                refused | imported
            ), refused
            assert lines[-1].startswith("kernels shardopt._C "), lines[-1]
        assert float(lines[-1].split()[-1]) < 1e-6, lines[-1]  # the step matches torch's


@pytest.mark.skipif(not X86_LEVELS, reason="x86-64 ISA modules only")
def test_a_module_its_cpu_check_refuses_falls_back_to_the_level_below():
    """When /proc/cpuinfo claims a level the module's own check does not find, the loader takes
    the next module down instead of failing (simulated: the C check sees avx2, cpuinfo avx512)."""
    _built_module(X86_LEVELS["avx512"])
    code = (
        "from shardopt.kernels import cpu_isa, loader\n"
        "cpu_isa.cpu_flags = lambda: frozenset().union(*cpu_isa._X86_LEVEL_FLAGS.values())\n"
        "print(loader.cpu_extension().__name__)\n"
    )
    out = _python(code, SHARDOPT_SIMULATE_CPU_LEVEL="avx2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"shardopt.{X86_LEVELS['avx2']}", out.stdout
