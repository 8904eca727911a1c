"""Where the CUDA matmul bindings' argument checks crash (GPU machine): each case in its own
child process with faulthandler on, then its exit code and the tail of its stderr; a case that
only runs a product (no bad argument) and exits tells a crash at exit from one at the raise.

    python3 launch_scripts/probe/probe_matmul_checks.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

SETUP = r"""
import sys, torch
from shardopt import kernels
ext = kernels.extension().cuda
y = torch.randn(2, 40, 24, device="cuda", dtype=torch.bfloat16)
s = torch.bmm(y, y.mT)
print("setup done", flush=True)
"""

CASES = {
    "product_only": "ext.symmetric_bmm(y, y.mT, 1.0, 2); torch.cuda.synchronize()",
    "product_only_bmm_add": "ext.bmm_add(y, y.mT, s, 1.0, 1.0); torch.cuda.synchronize()",
    "bmm_add_bad_c": "ext.bmm_add(y, y.mT, s[:, :-1], 1.0, 1.0)",
    "sym_not_square": "ext.symmetric_bmm(y, y[:, :30].mT, 1.0, 2)",
    "sym_blocks0": "ext.symmetric_bmm(y, y.mT, 1.0, 0)",
    "sym_no_chain": "ext.symmetric_bmm(y, y.mT[:, :-1], 1.0, 2)",
    "sym_dtypes": "ext.symmetric_bmm(y, y.mT.half(), 1.0, 2)",
    "sym_add_bad_c": "ext.symmetric_bmm_add(y, y.mT, s[:, :-1], 1.0, 1.0, 2)",
    "sym_not_square_cpu_check_only": "ext.symmetric_bmm(y.cpu(), y[:, :30].mT.cpu(), 1.0, 2)",
}

BODY = r"""
try:
    {call}
except RuntimeError as exc:
    print("raised:", str(exc).splitlines()[0][:160], flush=True)
else:
    print("returned", flush=True)
print("case done", flush=True)
"""


#: cases rerun with torch's C++ stack traces in the message (c10::Error's backtrace symbolized)
TRACED = ("sym_not_square", "bmm_add_bad_c")


def main() -> None:
    runs = [(name, call, {}) for name, call in CASES.items()]
    runs += [(f"{n}_cpp_trace", CASES[n], {"TORCH_SHOW_CPP_STACKTRACES": "1"}) for n in TRACED]
    for name, call, extra in runs:
        code = SETUP + BODY.format(call=call)
        out = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-c", code],
            capture_output=True, text=True, timeout=120, env={**os.environ, **extra},
        )  # fmt: skip
        print(f"== {name}: rc {out.returncode}")
        print("   stdout:", out.stdout.strip().replace("\n", " | ")[-400:])
        if out.returncode:
            print("   stderr:", out.stderr.strip()[-2500:])
    if shutil.which("gdb"):
        code = SETUP + BODY.format(call=CASES["sym_not_square"])
        out = subprocess.run(
            ["gdb", "-batch", "-ex", "run", "-ex", "bt 30", "--args", sys.executable, "-c", code],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        print("== gdb sym_not_square:\n", out.stdout[-6000:])
    else:
        print("== no gdb here")


if __name__ == "__main__":
    main()
