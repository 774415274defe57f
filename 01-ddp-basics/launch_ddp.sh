#!/usr/bin/env bash
# Every way to start the same DDP script, in one place.
#
#   bash 01-ddp-basics/launch_ddp.sh MODE [script arguments...]
#
# MODE       what starts the ranks                       settings it reads (environment)
# single     torchrun on this machine                    NPROC_PER_NODE MAX_RESTARTS
# static     torchrun on each node, fixed master         NNODES NODE_RANK MASTER_ADDR MASTER_PORT
# c10d       torchrun on each node, c10d rendezvous      NNODES RDZV_ENDPOINT RDZV_ID MAX_RESTARTS
# spawn      python + torch.multiprocessing.spawn        NPROC_PER_NODE
# srun       SLURM: one task per rank, no torchrun       NPROC_PER_NODE (tasks per node), NNODES
#
# SCRIPT selects the training script (default: 01-ddp-basics/ddp_training.py). Examples:
#   bash 01-ddp-basics/launch_ddp.sh single --steps 20
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash 01-ddp-basics/launch_ddp.sh static   # on node0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash 01-ddp-basics/launch_ddp.sh static   # on node1
#   NNODES=2 RDZV_ENDPOINT=node0:29400 bash 01-ddp-basics/launch_ddp.sh c10d          # on every node,
#                                                                    node0 included (it hosts the store)
set -euo pipefail

MODE=${1:?usage: launch_ddp.sh single|static|c10d|spawn|srun [script arguments...]}
shift
SCRIPT=${SCRIPT:-01-ddp-basics/ddp_training.py}
NPROC_PER_NODE=${NPROC_PER_NODE:-2}   # on GPU nodes: the number of GPUs per node
NNODES=${NNODES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-0}       # torchrun restarts all ranks this often after a failure
# torch >= 2.5 lets the workers share the rendezvous store; after a restart they can then read the
# previous attempt's addresses and fail to connect (pytorch/pytorch#135712). Give them their own.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

case "$MODE" in
single)
    # --standalone: a private rendezvous on a free local port; nothing to configure.
    exec torchrun --standalone --nproc_per_node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS" \
        "$SCRIPT" "$@" ;;
static)
    # Every node names the same master (node 0's address, a port open between the nodes) and its
    # own rank among the nodes. Ranks are node_rank * nproc_per_node + local_rank.
    exec torchrun --nnodes="$NNODES" --node_rank="${NODE_RANK:?set NODE_RANK}" \
        --nproc_per_node="$NPROC_PER_NODE" \
        --master_addr="${MASTER_ADDR:?set MASTER_ADDR}" --master_port="${MASTER_PORT:-29500}" \
        "$SCRIPT" "$@" ;;
c10d)
    # The nodes meet at a c10d rendezvous and are given their ranks there. Its TCP store is hosted
    # by the agent on the host RDZV_ENDPOINT names (it recognises its own name or address), so that
    # host must run this too, and the rendezvous lives as long as its agent. A failed or replaced
    # node can rejoin only with MAX_RESTARTS > 0 (the agents then restart every worker; resume with
    # --ckpt-dir) and the endpoint's node still up.
    exec torchrun --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" \
        --max-restarts="$MAX_RESTARTS" --rdzv_backend=c10d --rdzv_endpoint="${RDZV_ENDPOINT:?set RDZV_ENDPOINT host:port}" \
        --rdzv_id="${RDZV_ID:-ddp-job}" "$SCRIPT" "$@" ;;
spawn)
    # No launcher: the script starts its ranks with torch.multiprocessing.spawn (one node only).
    exec python "$SCRIPT" --spawn "$NPROC_PER_NODE" "$@" ;;
srun)
    # SLURM starts one task per rank; the script reads SLURM_PROCID / SLURM_STEP_NUM_TASKS /
    # SLURM_LOCALID, and every task meets at the first host of the step's node list
    # (dtcourse/launch.py).
    exec srun --nodes="$NNODES" --ntasks-per-node="$NPROC_PER_NODE" python "$SCRIPT" "$@" ;;
*)
    echo "launch_ddp.sh: unknown mode '$MODE' (single, static, c10d, spawn, srun)" >&2
    exit 2 ;;
esac
