#!/usr/bin/env bash
# Launch torchtrain on this machine with torchrun.
#   ./run_train.sh                                   # the debug job on 1 process (or every local GPU)
#   NGPU=4 ./run_train.sh --parallelism.data_parallel_replicate_degree 2   # HSDP 2x2
# Environment:
#   NGPU         processes on this node (default: the number of visible GPUs, or 1 without a GPU)
#   CONFIG_FILE  job file (default: train_configs/debug_model.toml)
#   LOG_RANK     ranks whose output is shown, e.g. 0, 0,1 or all (default 0)
# Every further argument is a config override: --section.key value
set -euo pipefail
cd "$(dirname "$0")"

if [ -z "${NGPU:-}" ]; then
  NGPU=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
  [ "$NGPU" -ge 1 ] || NGPU=1
fi
CONFIG_FILE=${CONFIG_FILE:-"./train_configs/debug_model.toml"}
export LOG_RANK=${LOG_RANK:-0}
export PYTHONUNBUFFERED=1
FILTER=()
[ "$LOG_RANK" = "all" ] || FILTER=(--local-ranks-filter "$LOG_RANK")

exec torchrun --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
  "${FILTER[@]}" --role rank --tee 3 \
  -m torchtrain.train --job.config_file "$CONFIG_FILE" "$@"
