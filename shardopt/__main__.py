"""``python -m shardopt``: which extension modules serve the kernels (loads or builds them).

Exit status: 0 printed, 2 the kernels cannot be loaded here (a bad ``SHARDOPT_CPU_CAPABILITY``, a
module built against another torch, a failed JIT build): one ``error: ...`` on stderr, no
traceback.
"""

import sys

from shardopt.kernels.loader import describe


def main() -> int:
    try:
        report = describe()
    except (ImportError, RuntimeError) as e:  # the loader's errors name the problem and the fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
