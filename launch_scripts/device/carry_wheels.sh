#!/usr/bin/env bash
# Makes, here (with the package registry), the ignored folders a device call carries: the GPU
# machine has no registry (its image: torch, Python 3.12, pytest, transformers, accelerate).
#   muon       .muonwheels/: bench_muon.py's peers (emerging-optimizers, heavyball, DeepSpeed) and
#              the dependencies the image lacks (device_run.sh's muon stage installs them)
#   deepspeed  .dswheels/: DeepSpeed and its dependencies (device_run.sh's deepspeed stage)
#   offload    .whl/: DeepSpeed, its dependencies and torchao (device_offload.sh)
#   apex DIR   .apex/: Apex's test_dist_adam.py and the files it imports, from the Apex git
#              directory DIR (e.g. the fetch tool's /work/.mirror/NVIDIA+apex/repo), and an
#              expecttest wheel in .apex/wheels (device_run.sh's apex_suite stage)
# Then name the folders in the device tool's carry (64 MiB in all; each is a few MiB).
#
#   bash launch_scripts/device/carry_wheels.sh muon apex /work/.mirror/NVIDIA+apex/repo
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
# the device image's Python and platform: pure-Python wheels, or binary ones built for it
TARGET=(--python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64)
# pydantic and pydantic-core as a matched pair (the one device_offload.sh's runs used)
DS_DEPS=(hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types typing-inspection
         typing-extensions py-cpuinfo msgpack psutil einops ninja)

deepspeed_wheels() {  # $1: the folder
  mkdir -p "$1"
  # DeepSpeed ships an sdist only; built without its ops (they JIT-compile on the GPU machine)
  DS_BUILD_OPS=0 $PY -m pip wheel -q "deepspeed==${DEEPSPEED_VERSION:-0.19.8}" --no-deps \
    --no-build-isolation -w "$1"
  $PY -m pip download -q --no-deps "${TARGET[@]}" -d "$1" "${DS_DEPS[@]}"
}

while [ $# -gt 0 ]; do
  case $1 in
    muon) rm -rf .muonwheels
          $PY -m pip download -q --no-deps "${TARGET[@]}" -d .muonwheels \
            "emerging-optimizers==${EMERGING_VERSION:-0.3.0}" "heavyball==${HEAVYBALL_VERSION:-3.2.1}" \
            absl-py opt-einsum
          deepspeed_wheels .muonwheels ;;
    deepspeed) rm -rf .dswheels; deepspeed_wheels .dswheels ;;
    offload) rm -rf .whl; deepspeed_wheels .whl
             # pure Python: torchao's CPUOffloadOptimizer needs no C++ op
             $PY -m pip download -q --no-deps "${TARGET[@]}" -d .whl "torchao==${TORCHAO_VERSION:-0.18.0}" ;;
    apex) src=${2:?usage: carry_wheels.sh apex APEX_GIT_DIR}; shift
          rm -rf .apex
          $PY launch_scripts/device/apex_suite.py extract --from "$src" --to .apex
          $PY -m pip download -q --no-deps "${TARGET[@]}" -d .apex/wheels expecttest ;;
    *) echo "unknown folder $1 (muon, deepspeed, offload, apex DIR)" >&2; exit 2 ;;
  esac
  shift
done
du -sh .muonwheels .dswheels .whl .apex 2>/dev/null || true
