#!/bin/bash
# Written by `distsetup slurm`; regenerate it rather than editing by hand:
#   distsetup slurm ...
#
# Runs distsetup.train (ddp) with torchrun on 4 node(s) x 8 GPU(s) = 32 process(es) in ONE world:
# srun starts one torchrun per node; each node's rank ($SLURM_NODEID) expands on that node.
# Change the size with --num_nodes / --num_gpus_per_node. Submit (extra arguments go to the training script):
#   sbatch scripts/slurm_job.sh training.max_steps=100
# Submit it from any folder (the job log goes where sbatch runs): it first enters WORKDIR (/home/user/project, where
# distsetup ran), to which every relative path here and in the run config refers.
#SBATCH --gres=gpu:8
#SBATCH --job-name=distsetup
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --output=%x-%j.out
#SBATCH --partition=gpu
#SBATCH --time=48:00:00
set -euo pipefail

# --- parameters ---
export NNODES="$SLURM_NNODES"
export NPROC_PER_NODE=8
# The whole host list, then its first entry: `scontrol ... | head -n1` dies of SIGPIPE (status 141 under
# pipefail) when scontrol writes a large allocation's list in several writes.
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MASTER_ADDR="${HOSTS[0]:?scontrol show hostnames listed no host for $SLURM_JOB_NODELIST}"
# From the job id, so that concurrent jobs do not collide, and below Linux's ephemeral ports (32768 up), which
# the node's own outgoing connections take
export MASTER_PORT="$((20000 + SLURM_JOB_ID % 12000))"
export RDZV_ID="$SLURM_JOB_ID"
export WORKDIR=/home/user/project  # where distsetup ran: relative paths here and in the run config start there
export MODULE=distsetup.train
TRAIN_ARGS=(--config config.yaml distributed.backend=ddp)

# --- environment ---
cd "$WORKDIR" || { echo "distsetup: cannot enter $WORKDIR (where this script was written): regenerate it in the project folder or edit WORKDIR" >&2; exit 1; }
# export OMP_NUM_THREADS=1  # CPU threads per process (torchrun sets 1 when unset)
# export NCCL_DEBUG=INFO  # NCCL logging: WARN, INFO (connection set-up), TRACE
# export NCCL_SOCKET_IFNAME=eth0  # network interface NCCL uses between nodes
# export NCCL_IB_DISABLE=1  # 1 = no InfiniBand (use TCP sockets)
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=2  # a collective that times out raises in each rank, which says so, instead of hanging (1, 3: NCCL ends it)
# export CUDA_DEVICE_MAX_CONNECTIONS=1  # 1 lets tensor-parallel compute and communication overlap

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
echo "distsetup: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: $NNODES node(s) x $NPROC_PER_NODE = $((NNODES * NPROC_PER_NODE)) process(es), master $MASTER_ADDR:$MASTER_PORT" >&2
# --export=ALL: the variables above reach the nodes also where sbatch ran with --export=NONE (a site's SBATCH_EXPORT)
SRUN_ARGS=(--nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --export=ALL)
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
  SRUN_ARGS+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")  # srun does not inherit it from sbatch
fi
# SLURM sends SIGTERM to this shell too (scancel, scontrol requeue, the time limit): caught, so that it lives until
# srun ends, and srun, which relays what the training processes print, until they have checkpointed and said so.
trap : TERM
# The single-quoted program runs once per node; its $VARIABLES expand there, not here.
# shellcheck disable=SC2016
srun "${SRUN_ARGS[@]}" bash -c '
set -euo pipefail
NODE_RANK="$SLURM_NODEID"
# SLURM may send USR1 to every process of the job (scancel --signal=USR1, --signal=USR1@N without B:). This shell
# takes it from its first line: node 0 tells the batch shell, which runs there, and a requeueing job is requeued
# whatever its ranks had done (during their set-up they die of it, leaving no checkpoint and no word of it).
# torchrun has no handler for it: it would die of it, and its processes train on alone. So it starts with
# the signal ignored, and this shell hands it SIGTERM instead, which it forwards: they checkpoint and stop.
RUNNER_PID=""
usr1_received=0
step_ending=0  # a SIGTERM came: SLURM ends the step (trapped so from the launch on)
# shellcheck disable=SC2317  # run by the trap below
take_preemption_notice() {
  usr1_received=1
  if [[ -n "${DISTSETUP_PREEMPTED_FILE:-}" ]] && ((NODE_RANK == 0)); then
    : >"$DISTSETUP_PREEMPTED_FILE"
  fi
  hand_notice_on_as_sigterm
}
# Once, and only to a launcher that has started (called again as it starts): a second SIGTERM would end its wait for
# the checkpoint of its ranks, and it would exit while they still write it.
sigterm_handed_on=0
hand_notice_on_as_sigterm() {
  if [[ -n "$RUNNER_PID" ]] && ((usr1_received && !sigterm_handed_on)); then
    sigterm_handed_on=1
    kill -TERM "$RUNNER_PID" 2>/dev/null || true
  fi
}
# Ends this program with status $1. A node other than 0 that took a notice and failed waits first, up to 10 s or until
# SLURM ends the step (SIGTERM): its end would have srun end the step (--kill-on-bad-exit) before node 0, which tells
# the batch shell, took the same notice (SLURM may send it to the nodes seconds apart).
end_node_program() {
  if (($1 != 0 && usr1_received && NODE_RANK != 0)) && [[ -n "${DISTSETUP_PREEMPTED_FILE:-}" ]]; then
    local seconds=0
    trap "step_ending=1" TERM
    while ((!step_ending && seconds++ < 10)); do
      sleep 1 || true  # SLURM signals it too
    done
  fi
  exit "$1"
}
trap take_preemption_notice USR1
echo "distsetup: node ${SLURMD_NODENAME:-$(hostname)}: node_rank $NODE_RANK of $NNODES, $NPROC_PER_NODE process(es)" >&2
cd "$WORKDIR"  # srun starts here already; a node without the folder would start in /tmp instead
LAUNCH=(torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE")
LAUNCH+=(--rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID")
# Started with USR1 ignored, which it keeps (the handler of this shell, from _usr1_on_node, is reset in a child)
(trap "" USR1 && exec "${LAUNCH[@]}" -m "$MODULE" "$@") &
RUNNER_PID=$!
hand_notice_on_as_sigterm  # a preemption notice before the launcher had started: it stops as it starts
trap "step_ending=1" TERM  # SLURM signals every process of the job; caught, so that this shell waits for the checkpoint
status=0
wait "$RUNNER_PID" || status=$?
while kill -0 "$RUNNER_PID" 2>/dev/null; do  # a signal ended the wait, not the launcher: wait for it
  status=0
  wait "$RUNNER_PID" || status=$?
done
end_node_program "$status"
' distsetup-node "${TRAIN_ARGS[@]}" "$@"
