#!/usr/bin/env bash
# Written by `distsetup launcher`; regenerate it rather than editing by hand:
#   distsetup launcher ...
#
# Runs distsetup.train (fsdp) with torchrun: 2 node(s) x 2 process(es) per node = 4 process(es).
# Run this script on every node; c10d assigns the node ranks as the nodes join.
# Change the world size with --num_nodes / --num_gpus_per_node; extra arguments go to the training script:
#   bash scripts/run_training.sh training.max_steps=100
# Runs from any folder: it first enters WORKDIR (/home/user/project, where distsetup ran), to which every relative
# path here and in the run config refers. For another machine or checkout, regenerate it there.
set -euo pipefail

# --- parameters ---
NNODES=2
NPROC_PER_NODE=2
MASTER_ADDR='node0'
MASTER_PORT=29400
RDZV_ID=distsetup
WORKDIR=/home/user/project  # where distsetup ran: relative paths here and in the run config start there
MODULE=distsetup.train
TRAIN_ARGS=(--config config.yaml distributed.backend=fsdp 'distributed.fsdp_config="config/fsdp_config.json"' distributed.timeout_minutes=45)

# --- environment ---
cd "$WORKDIR" || { echo "distsetup: cannot enter $WORKDIR (where this script was written): regenerate it in the project folder or edit WORKDIR" >&2; exit 1; }
export CUDA_VISIBLE_DEVICES=2,3  # chosen with --gpus
export CUDA_DEVICE_ORDER=PCI_BUS_ID  # number GPUs in PCI bus order, as nvidia-smi and --gpus do
export OMP_NUM_THREADS=8  # CPU threads per process (torchrun sets 1 when unset)
export NCCL_DEBUG=WARN  # NCCL logging: WARN, INFO (connection set-up), TRACE
# export NCCL_SOCKET_IFNAME=eth0  # network interface NCCL uses between nodes
export NCCL_IB_DISABLE=1  # 1 = no InfiniBand (use TCP sockets)
export TORCH_NCCL_ASYNC_ERROR_HANDLING=2  # a collective that times out raises in each rank, which says so, instead of hanging (1, 3: NCCL ends it)
# export CUDA_DEVICE_MAX_CONNECTIONS=1  # 1 lets tensor-parallel compute and communication overlap
gpu_count() {
  local devices
  devices="$(compgen -G '/dev/nvidia[0-9]*' || true)"
  if [[ -z "$devices" && ! -e /dev/kfd ]] && ! command -v nvidia-smi >/dev/null && ! command -v rocm-smi >/dev/null; then
    echo 0  # no NVIDIA or AMD GPU on this machine, whatever CUDA_VISIBLE_DEVICES names
  elif [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    local ids
    IFS=, read -r -a ids <<<"$CUDA_VISIBLE_DEVICES"
    echo "${#ids[@]}"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
  else
    grep -c . <<<"$devices"
  fi
}
GPUS_FOUND="$(gpu_count)"
if [[ "$GPUS_FOUND" -eq 0 ]]; then
  echo "distsetup: --gpus $CUDA_VISIBLE_DEVICES chose GPUs, but this machine has none; for CPU processes regenerate without --gpus" >&2
  exit 1
fi
if [[ "$GPUS_FOUND" -eq 0 ]]; then
  echo "distsetup: no GPUs found: starting $NPROC_PER_NODE CPU process(es) per node (gloo)" >&2
elif [[ "$GPUS_FOUND" -lt "$NPROC_PER_NODE" ]]; then
  echo "distsetup: warning: $NPROC_PER_NODE processes per node but only $GPUS_FOUND GPU(s) visible" >&2
fi

# --- command ---
# The run config and the arguments, checked once before anything starts: a problem is one line, not one per process.
# It runs on the interpreter torchrun runs the trainer on: the python3 beside it (a venv's or conda env's).
PYTHON="$(command -v torchrun || true)"
PYTHON="${PYTHON%/*}/python3"
[[ -x "$PYTHON" ]] || PYTHON=python3
# With WORLD_SIZE the world the launcher forms, where this script knows it (numbers, not auto): backend single
# trains one process, and a DeepSpeed file's batch is that of one world
CHECKED_WORLD=()
if [[ "$NNODES" =~ ^[0-9]+$ && "$NPROC_PER_NODE" =~ ^[0-9]+$ ]]; then
  CHECKED_WORLD=("WORLD_SIZE=$((10#$NNODES * 10#$NPROC_PER_NODE))")
fi
env "${CHECKED_WORLD[@]}" "$PYTHON" -m "$MODULE" --check "${TRAIN_ARGS[@]}" "$@"
echo "distsetup: one of $NNODES node(s) (c10d assigns node ranks), $NPROC_PER_NODE process(es) per node, master $MASTER_ADDR:$MASTER_PORT" >&2
set -- "${TRAIN_ARGS[@]}" "$@"
LAUNCH=(torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE")
LAUNCH+=(--rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID")
echo "distsetup: preflight: all-reduce and barrier across the world before training" >&2
"${LAUNCH[@]}" -m distsetup.preflight
exec "${LAUNCH[@]}" -m "$MODULE" "$@"
