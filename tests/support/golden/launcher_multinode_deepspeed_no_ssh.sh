#!/usr/bin/env bash
# Written by `distsetup launcher`; regenerate it rather than editing by hand:
#   distsetup launcher ...
#
# Runs distsetup.train (deepspeed) with deepspeed: 2 node(s) x 8 process(es) per node = 16 process(es).
# Run this script on every node; each node needs its own NODE_RANK (0..1).
# Change the world size with --num_nodes / --num_gpus_per_node; extra arguments go to the training script:
#   bash scripts/run_training.sh training.max_steps=100
# Runs from any folder: it first enters WORKDIR (/home/user/project, where distsetup ran), to which every relative
# path here and in the run config refers. For another machine or checkout, regenerate it there.
set -euo pipefail

# --- parameters ---
NNODES=2
NPROC_PER_NODE=8
NODE_RANK="${NODE_RANK:-1}"  # NODE_RANK in the environment wins
MASTER_ADDR='10.1.2.3'
MASTER_PORT=29500
WORKDIR=/home/user/project  # where distsetup ran: relative paths here and in the run config start there
MODULE=distsetup.train
TRAIN_ARGS=(--config config.yaml distributed.backend=deepspeed --deepspeed config/ds_config.json)
HOSTS=(node0 node1)  # hostfile names: labels only with --no_ssh

# --- environment ---
cd "$WORKDIR" || { echo "distsetup: cannot enter $WORKDIR (where this script was written): regenerate it in the project folder or edit WORKDIR" >&2; exit 1; }
# export OMP_NUM_THREADS=1  # CPU threads per process (the deepspeed launcher leaves it unset: each process then takes every core)
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
# It runs on the interpreter deepspeed runs the trainer on: the python3 beside it (a venv's or conda env's).
PYTHON="$(command -v deepspeed || true)"
PYTHON="${PYTHON%/*}/python3"
[[ -x "$PYTHON" ]] || PYTHON=python3
# With WORLD_SIZE the world the launcher forms, where this script knows it (numbers, not auto): backend single
# trains one process, and a DeepSpeed file's batch is that of one world
CHECKED_WORLD=()
if [[ "$NNODES" =~ ^[0-9]+$ && "$NPROC_PER_NODE" =~ ^[0-9]+$ ]]; then
  CHECKED_WORLD=("WORLD_SIZE=$((10#$NNODES * 10#$NPROC_PER_NODE))")
fi
env "${CHECKED_WORLD[@]}" "$PYTHON" -m "$MODULE" --check "${TRAIN_ARGS[@]}" "$@"
echo "distsetup: node $NODE_RANK of $NNODES, $NPROC_PER_NODE process(es) per node, master $MASTER_ADDR:$MASTER_PORT" >&2
HOSTFILE="$(mktemp)"  # the deepspeed launcher's hostfile, with this node's process count as slots
for host in "${HOSTS[@]}"; do
  echo "$host slots=$NPROC_PER_NODE"
done >"$HOSTFILE"
set -- "${TRAIN_ARGS[@]}" "$@"
LAUNCH=(deepspeed --hostfile "$HOSTFILE" --no_ssh --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
# The process of the deepspeed launcher (runner.py) has a SIGTERM handler only with pdsh: SIGTERM ends it alone,
# while the launch.py it started (which has one: it stops the ranks, SIGKILL 30 s later) and the ranks go on. So
# this shell starts it as a child rather than becoming it, and ends with it and what it started.
"${LAUNCH[@]}" --module "$MODULE" "$@" &
RUNNER_PID=$!
# A SIGTERM to this script (kill PID, a supervisor) goes on to launch.py, and the ranks checkpoint.
# shellcheck disable=SC2317  # run by the trap below
hand_sigterm_to_launch_py() {
  local launch_py="" tries=0
  while [[ -z "$launch_py" ]] && ((tries++ < 100)); do  # up to 10 s, while the runner starts it
    launch_py="$(cat "/proc/$RUNNER_PID/task/$RUNNER_PID/children" 2>/dev/null || pgrep -P "$RUNNER_PID" || true)"
    [[ -n "$launch_py" ]] || sleep 0.1
  done
  read -r launch_py _ <<<"$launch_py"  # the first process id (the file ends with a space, pgrep with a newline)
  # launch.py sets its SIGTERM handler just after it has started its ranks: a SIGTERM before would end it alone,
  # and the runner, seeing no positive exit status, would exit 0 as if the run had finished
  local name value mask
  while [[ -n "$launch_py" ]] && ((tries++ < 200)); do  # up to 10 s more
    mask=""
    while read -r name value; do
      [[ "$name" != "SigCgt:" ]] || mask="$value"
    done <"/proc/$launch_py/status" 2>/dev/null || break  # it ended
    (((16#${mask:-0} & 1 << 14) == 0)) || break  # it catches SIGTERM (signal 15)
    sleep 0.1
  done
  [[ -z "$launch_py" ]] || kill -TERM "$launch_py" 2>/dev/null || true
}
trap hand_sigterm_to_launch_py TERM
status=0
wait "$RUNNER_PID" || status=$?
while kill -0 "$RUNNER_PID" 2>/dev/null; do  # a signal ended the wait, not the launcher: wait for it
  status=0
  wait "$RUNNER_PID" || status=$?
done
exit "$status"
