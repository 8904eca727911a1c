#!/usr/bin/env bash
# Train the example GPT on this machine's CPUs: NPROC processes (default 2), gloo backend.
#
#   launch_scripts/train/run_cpu.sh                                   # the default run, ~2 min on 2 cores
#   NPROC=4 launch_scripts/train/run_cpu.sh --optimizer lamb --steps 1000
#   launch_scripts/train/run_cpu.sh --baseline ddp                    # DDP + FusedAdam, for comparison
#
# Arguments go to train_gpt.py (python launch_scripts/train/train_gpt.py --help lists them). Each process
# gets cores // NPROC intra-op threads.
#
# Multi-node: run this on every node with --standalone replaced by the rendezvous arguments:
#   torchrun --nnodes 2 --nproc-per-node 2 \
#       --rdzv-backend c10d --rdzv-endpoint HOST0:29500 --rdzv-id my-job \
#       launch_scripts/train/train_gpt.py --device cpu ...
# where HOST0 is a host name every node can reach (it serves the rendezvous); the c10d rendezvous
# assigns node ranks. With a static rendezvous, give each node --node-rank 0..N-1 and
# --master-addr HOST0 --master-port 29500 instead.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"  # works from a checkout without pip install
exec torchrun --standalone --nproc-per-node "${NPROC:-2}" \
    "$repo/launch_scripts/train/train_gpt.py" --device cpu "$@"
