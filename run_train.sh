#!/usr/bin/env bash
# Launch torchtrain on this machine with torchrun (one node), or as one node of a multi-node job.
#   ./run_train.sh                                   # the debug job on 1 process (or every local GPU)
#   NGPU=4 ./run_train.sh --parallelism.data_parallel_replicate_degree 2   # HSDP 2x2
#   # two nodes, run on each (node ranks 0 and 1) with the first node's address:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 ./run_train.sh ...
# Environment:
#   NGPU         processes on this node (default: the number of visible GPUs, or 1 without a GPU)
#   CONFIG_FILE  job file (default: train_configs/debug_model.toml)
#   LOG_RANK     local ranks whose output is shown, e.g. 0, 0,1 or all (default 0)
# Multi-node (docs/cluster.md; on SLURM use scripts/multinode_trainer.slurm):
#   NNODES       number of nodes (default 1: everything below is ignored), or MIN:MAX with RDZV_ENDPOINT: the job
#                starts with as many as join (up to MAX) and goes on with those left (at least MIN) when one is lost
#   NODE_RANK, MASTER_ADDR, MASTER_PORT
#                static rendezvous: this node's rank (0 .. NNODES-1), and the address and a free port
#                of node 0 (default port 29500); every node gets the same MASTER_ADDR/MASTER_PORT
#   RDZV_ENDPOINT, RDZV_ID
#                or dynamic c10d rendezvous at host:port (node ranks are assigned on arrival),
#                with a job id shared by all nodes (default "torchtrain")
# Every further argument is a config override: --section.key value
# The job is checked once before torchrun starts (python -m torchtrain.launch_check, for NGPU x NNODES
# processes): a bad job prints one "torchtrain: config error: ..." line and exits 2.
# torchrun runs inside python -m torchtrain.launcher: it restarts the workers after a failure up to
# fault.max_restarts times (resuming from the newest complete checkpoint), and exits with the workers'
# own status when they explained it (2 config error, 3 guard abort, 4 hang; docs/resilience.md).
set -euo pipefail
cd "$(dirname "$0")"

CONFIG_FILE=${CONFIG_FILE:-"./train_configs/debug_model.toml"}
NNODES=${NNODES:-1}
export LOG_RANK=${LOG_RANK:-0}
export PYTHONUNBUFFERED=1
FILTER=()
[ "$LOG_RANK" = "all" ] || FILTER=(--local-ranks-filter "$LOG_RANK")

if [ "$NNODES" = "1" ]; then
  # One node: a free port on localhost.
  RDZV=(--rdzv_backend c10d --rdzv_endpoint="localhost:0")
elif [ -n "${RDZV_ENDPOINT:-}" ]; then
  RDZV=(--nnodes="$NNODES" --rdzv_backend c10d --rdzv_endpoint="$RDZV_ENDPOINT" --rdzv_id="${RDZV_ID:-torchtrain}")
elif [ -n "${MASTER_ADDR:-}" ] && [ -n "${NODE_RANK:-}" ]; then
  case "$NNODES" in *:*)
    echo "run_train.sh: NNODES=$NNODES (a range of nodes) needs RDZV_ENDPOINT (c10d rendezvous): a static" \
         "rendezvous (NODE_RANK, MASTER_ADDR) has a fixed number of nodes; see docs/cluster.md" >&2
    exit 2;;
  esac
  RDZV=(--nnodes="$NNODES" --node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="${MASTER_PORT:-29500}")
else
  echo "run_train.sh: NNODES=$NNODES needs either NODE_RANK and MASTER_ADDR (static rendezvous) or" \
       "RDZV_ENDPOINT (c10d rendezvous); see docs/cluster.md" >&2
  exit 2
fi

# Check the job in this one process (no torchrun, no traceback, no wait on other ranks); it prints the
# processes per node (NGPU, or every visible GPU / 1 when unset).
NGPU=$(python -m torchtrain.launch_check --nproc-per-node "${NGPU:-auto}" --nnodes "$NNODES" \
         --job.config_file "$CONFIG_FILE" "$@") || exit $?

exec python -m torchtrain.launcher --nproc_per_node="$NGPU" "${RDZV[@]}" \
  "${FILTER[@]}" --role rank --tee 3 \
  -m torchtrain.train --job.config_file "$CONFIG_FILE" "$@"
