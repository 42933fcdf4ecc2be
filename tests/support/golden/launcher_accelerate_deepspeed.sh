#!/usr/bin/env bash
# Written by `distsetup launcher`; regenerate it rather than editing by hand:
#   distsetup launcher ...
#
# Runs distsetup.train (deepspeed) with accelerate: 1 node(s) x 4 process(es) per node = 4 process(es).
# Change the world size with --num_gpus_per_node (or --gpus); extra arguments go to the training script:
#   bash scripts/run_training.sh training.max_steps=100
# Runs from any folder: it first enters WORKDIR (/home/user/project, where distsetup ran), to which every relative
# path here and in the run config refers. For another machine or checkout, regenerate it there.
set -euo pipefail

# --- parameters ---
NNODES=1
NPROC_PER_NODE=4
NODE_RANK="${NODE_RANK:-0}"  # NODE_RANK in the environment wins
MASTER_ADDR='127.0.0.1'
WORKDIR=/home/user/project  # where distsetup ran: relative paths here and in the run config start there
MODULE=distsetup.train
TRAIN_ARGS=(--config config.yaml distributed.backend=deepspeed --deepspeed ds.json)
DEEPSPEED_CONFIG=ds.json

# --- environment ---
cd "$WORKDIR" || { echo "distsetup: cannot enter $WORKDIR (where this script was written): regenerate it in the project folder or edit WORKDIR" >&2; exit 1; }
# export OMP_NUM_THREADS=1  # CPU threads per process (accelerate sets 1 when unset, or with its --cpu the cores over the processes)
# export NCCL_DEBUG=INFO  # NCCL logging: WARN, INFO (connection set-up), TRACE
# export NCCL_SOCKET_IFNAME=eth0  # network interface NCCL uses between nodes
# export NCCL_IB_DISABLE=1  # 1 = no InfiniBand (use TCP sockets)
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=2  # a collective that times out raises in each rank, which says so, instead of hanging (1, 3: NCCL ends it)
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
  echo "distsetup: no GPUs found: starting $NPROC_PER_NODE CPU process(es) per node (gloo)" >&2
elif [[ "$GPUS_FOUND" -lt "$NPROC_PER_NODE" ]]; then
  echo "distsetup: warning: $NPROC_PER_NODE processes per node but only $GPUS_FOUND GPU(s) visible" >&2
fi

# --- command ---
# The run config and the arguments, checked once before anything starts: a problem is one line, not one per process.
# It runs on the interpreter accelerate runs the trainer on: the python3 beside it (a venv's or conda env's).
PYTHON="$(command -v accelerate || true)"
PYTHON="${PYTHON%/*}/python3"
[[ -x "$PYTHON" ]] || PYTHON=python3
# With WORLD_SIZE the world the launcher forms, where this script knows it (numbers, not auto): backend single
# trains one process, and a DeepSpeed file's batch is that of one world
CHECKED_WORLD=()
if [[ "$NNODES" =~ ^[0-9]+$ && "$NPROC_PER_NODE" =~ ^[0-9]+$ ]]; then
  CHECKED_WORLD=("WORLD_SIZE=$((10#$NNODES * 10#$NPROC_PER_NODE))")
fi
env "${CHECKED_WORLD[@]}" "$PYTHON" -m "$MODULE" --check "${TRAIN_ARGS[@]}" "$@"
MASTER_PORT=0  # accelerate launch takes a free port: the launchers' default, 29500, may be another run's
echo "distsetup: node $NODE_RANK of $NNODES, $NPROC_PER_NODE process(es) per node, on a free port (accelerate chooses it)" >&2
set -- "${TRAIN_ARGS[@]}" "$@"
LAUNCH=(accelerate launch --num_machines "$NNODES" --num_processes "$((NNODES * NPROC_PER_NODE))" --machine_rank "$NODE_RANK" --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT")
# The GPUs this environment shows (--gpus, a scheduler), where accelerate would set the gpu_ids of its default config
LAUNCH+=(--gpu_ids all)
# The trainer takes its precision and torch.compile from the run config, never from accelerate: said here, which
# quiets the warning accelerate gives for every value it had to default
LAUNCH+=(--dynamo_backend no)
# Without a GPU an Accelerator forms a world of CPU processes (gloo) only when told to: otherwise each process
# trains alone, a world of one. A GPU is one nvidia-smi lists, else one torch sees (ROCm, Intel XPU).
sees_a_gpu() {
  [[ "${CUDA_VISIBLE_DEVICES-unset}" != "" ]] || return 1
  nvidia-smi -L >/dev/null 2>&1 && return 0
  local python
  python="$(command -v accelerate || true)"
  python="${python%/*}/python3"
  [[ -x "$python" ]] || python=python3
  "$python" -c "import sys, torch; sys.exit(not (torch.cuda.is_available() or torch.xpu.is_available()))" 2>/dev/null
}
if [[ -z "${ACCELERATE_USE_CPU:-}" ]] && ! sees_a_gpu; then
  export ACCELERATE_USE_CPU=true
fi
# --mixed_precision no: the file says the precision (the HF Trainer its own flags); told none, accelerate takes
# the one of its default config (which accelerate config writes), where there is one, and then refuses the file
LAUNCH+=(--use_deepspeed --deepspeed_config_file "$DEEPSPEED_CONFIG" --mixed_precision no)
if ((NNODES > 1)); then  # else accelerate runs the deepspeed launcher with pdsh and no hostfile: each node alone
  LAUNCH+=(--deepspeed_multinode_launcher standard)
fi
exec "${LAUNCH[@]}" -m "$MODULE" "$@"
