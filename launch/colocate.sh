#!/usr/bin/env bash
# Colocated training (engine and learner share the devices) under torchrun.
#
#   [NNODES=1] [NPROC_PER_NODE=1] [NODE_RANK=0] [MASTER_ADDR=127.0.0.1] [MASTER_PORT=29500] \
#     launch/colocate.sh CONFIG [key=value ...]
#
# If the config's folder has a prepare.py (e.g. pipelines/arith), it runs first on each node's
# first process: it builds local models and data and is idempotent.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: launch/colocate.sh CONFIG [key=value ...]" >&2
  exit 2
fi
CONFIG=$1
shift
NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
# Multi-GPU hygiene required on the lent H200 hosts (NVLink multicast stays off).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
PREPARE="$(dirname "$CONFIG")/prepare.py"
if [[ -f "$PREPARE" ]]; then
  "$PY" "$PREPARE" --config "$CONFIG" "$@"
fi
exec "$PY" -m torch.distributed.run \
  --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" --node_rank "$NODE_RANK" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  -m streamrft.cli train "$CONFIG" "$@"
