#!/usr/bin/env bash
# Train the example GPT on this node's GPUs: NPROC processes (default: one per visible GPU), NCCL
# backend, bf16 autocast.
#
#   launch_scripts/train/run_gpu.sh                                   # the tiny default model
#   launch_scripts/train/run_gpu.sh --model small --batch-size 64 --block-size 256 --steps 2000
#   launch_scripts/train/run_gpu.sh --model gpt2 --data data/openwebtext/train.bin \
#       --batch-size 16 --grad-accum 4 --ckpt-dir ckpt --ckpt-interval 500
#   NPROC=2 launch_scripts/train/run_gpu.sh --baseline ddp            # DDP + FusedAdam, for comparison
#
# Arguments go to train_gpt.py (python launch_scripts/train/train_gpt.py --help lists them).
#
# Multi-node: run this on every node with --standalone replaced by the rendezvous arguments:
#   torchrun --nnodes 2 --nproc-per-node 8 \
#       --rdzv-backend c10d --rdzv-endpoint HOST0:29500 --rdzv-id my-job \
#       launch_scripts/train/train_gpt.py ...
# where HOST0 is a host name every node can reach (it serves the rendezvous); the c10d rendezvous
# assigns node ranks. With a static rendezvous, give each node --node-rank 0..N-1 and
# --master-addr HOST0 --master-port 29500 instead. --resume (no path) with a shared --ckpt-dir
# restarts a preempted job from its latest checkpoint with the same command.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"  # works from a checkout without pip install
nproc="${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count())')}"
if [ "$nproc" -lt 1 ]; then
    echo "run_gpu.sh: no CUDA GPU visible; use launch_scripts/train/run_cpu.sh" >&2
    exit 1
fi
exec torchrun --standalone --nproc-per-node "$nproc" \
    "$repo/launch_scripts/train/train_gpt.py" --device cuda "$@"
