#!/usr/bin/env bash
# An A/B of two trees' Python in one device call, on one host: writes ab_old/shardopt, the
# shardopt package of git revision REV, plus a module that loads the kernels the device call
# builds for this tree (so the Python of REV runs over this tree's kernels: only for revisions
# whose csrc/ is this tree's less lines this tree added). Run here, before the call (ab_old/ is
# ignored: name it in the device tool's carry):
#
#   bash launch_scripts/device/ab_tree.sh 1bf6840
#   # then, as the device command (carry .whl and ab_old), REV's rows alternated with this tree's:
#   OLD="PYTHONPATH=$PWD/ab_old:/tmp/site,AB_BUILD_DIR=$PWD/.build"
#   OFFLOAD_SETTINGS="$OLD default $OLD default" bash launch_scripts/device/device_offload.sh settings
set -euo pipefail
REV=${1:?usage: bash launch_scripts/device/ab_tree.sh REV}
# csrc/ may differ by added lines only (new kernels, their registrations): REV's Python then runs
# the kernels it knew, unchanged; a deleted or changed line refuses the A/B.
deleted=$(git diff --numstat "$REV" -- csrc | awk '{s += $2} END {print s + 0}')
if [ "$deleted" -gt 0 ]; then
  echo "csrc/ differs between $REV and the working tree by $deleted changed or deleted line(s):" \
       "its kernels would not be $REV's" >&2
  exit 1
fi
if ! git diff --quiet "$REV" -- csrc; then
  echo "csrc/: this tree adds to $REV's kernels (added lines only):" \
       "$(git diff --numstat "$REV" -- csrc | awk '{print $3}' | tr '\n' ' ')"
fi
rm -rf ab_old && mkdir ab_old
git archive "$REV" shardopt | tar -x -C ab_old
cat > ab_old/shardopt/_C.py <<'PY'
# A/B only (launch_scripts/device/ab_tree.sh): this tree's JIT-built kernels (AB_BUILD_DIR) as shardopt._C.
import glob
import importlib.util
import os
import sys

_path = sorted(glob.glob(os.path.join(os.environ["AB_BUILD_DIR"], "*", "shardopt_C.so")))[0]
_spec = importlib.util.spec_from_file_location("shardopt_C", _path)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
sys.modules[__name__] = _mod
PY
echo "ab_old/shardopt: the Python of $(git rev-parse --short "$REV")"
