#!/usr/bin/env bash
# Multi-node launch of the training example (docs/multinode.md). Run it once on every node, with
# the same NNODES, MASTER_ADDR, MASTER_PORT and RDZV_ID; arguments go to train_gpt.py.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash launch_scripts/train/multinode.sh --hsdp   # on node0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash launch_scripts/train/multinode.sh --hsdp   # on node1
#
# Environment:
#   NNODES          nodes (default 1)
#   NODE_RANK       this node, 0 .. NNODES-1 (default 0). With the c10d rendezvous node 0 hosts
#                   the rendezvous store (is_host); torchrun orders the nodes at rendezvous, so
#                   global ranks need not follow NODE_RANK. With RDZV_BACKEND=static it is the
#                   node's rank (--node-rank).
#   NPROC_PER_NODE  processes per node (default: the GPUs of this node, else 1)
#   MASTER_ADDR     host of node 0, reachable from every node (default localhost)
#   MASTER_PORT     rendezvous port on MASTER_ADDR (default 29500)
#   RDZV_ID         job id shared by the nodes of one job (default shardopt)
#   RDZV_BACKEND    c10d (default: elastic, restarts) or static
#   MAX_RESTARTS    torchrun restarts of the workers after a failure (default 0); pair it with
#                   train_gpt.py's --ckpt-dir, --ckpt-interval and --resume
#   PYTHON          the interpreter (default python3)
#   TORCH_DISABLE_SHARE_RDZV_TCP_STORE  1 by default here: each restart round gets a fresh store
#                   for the workers' process group. With torch's default (0) the workers of every
#                   round share the rendezvous store, and a restarted gloo group can read the
#                   previous round's addresses and fail to connect (docs/multinode.md).
set -euo pipefail
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ID="${RDZV_ID:-shardopt}"
RDZV_BACKEND="${RDZV_BACKEND:-c10d}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
PYTHON="${PYTHON:-python3}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 1)')"
fi

cmd=("$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
     --max-restarts "$MAX_RESTARTS")
case "$RDZV_BACKEND" in
    c10d)
        is_host=false
        [[ "$NODE_RANK" == 0 ]] && is_host=true
        cmd+=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
              --rdzv-conf "is_host=$is_host")
        ;;
    static)
        cmd+=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
        ;;
    *)
        echo "multinode.sh: RDZV_BACKEND must be c10d or static, got $RDZV_BACKEND" >&2
        exit 2
        ;;
esac
cmd+=("$(dirname "$0")/train_gpt.py" "$@")
echo "node $NODE_RANK: ${cmd[*]}" >&2
exec "${cmd[@]}"
