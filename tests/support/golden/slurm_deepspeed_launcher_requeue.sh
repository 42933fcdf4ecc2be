#!/bin/bash
# Written by `distsetup slurm`; regenerate it rather than editing by hand:
#   distsetup slurm ...
#
# Runs distsetup.train (deepspeed) with deepspeed on 2 node(s) x 8 GPU(s) = 16 process(es) in ONE world:
# srun starts one deepspeed per node; each node's rank ($SLURM_NODEID) expands on that node.
# Change the size with --num_nodes / --num_gpus_per_node. Submit (extra arguments go to the training script):
#   sbatch scripts/slurm_job.sh training.max_steps=100
# Submit it from any folder (the job log goes where sbatch runs): it first enters WORKDIR (/home/user/project, where
# distsetup ran), to which every relative path here and in the run config refers.
# The deepspeed launcher uses local GPU ids 0..N-1 on each node (its hostfile resets CUDA_VISIBLE_DEVICES):
# right only where SLURM constrains each job to its own GPUs (cgroups); torchrun (the default) keeps SLURM's.
# --requeue: the deepspeed launcher SIGKILLs the training processes 30 s after SIGTERM (fixed in
# deepspeed/launcher/launch.py), so a checkpoint that takes longer is lost; torchrun (the default) would
# wait 270 s here (300 s of warning less a margin for the requeue).
#SBATCH --account=ml
#SBATCH --cpus-per-task=64
#SBATCH --gpus-per-node=8
#SBATCH --job-name=distsetup
#SBATCH --mem-per-gpu=64G
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --time=1-00:00:00
set -euo pipefail
# A time limit no longer than SLURM's warning (an sbatch --time given at submission) has SLURM warn at once: each run
# would checkpoint as it starts and requeue, without end. squeue shows it as [D-][HH:]MM:SS.
JOB_TIME_LIMIT="$(squeue -h -j "$SLURM_JOB_ID" -o %l 2>/dev/null || true)"
if [[ "$JOB_TIME_LIMIT" =~ ^(([0-9]+)-)?(([0-9]+):)?([0-9]+):([0-9]+)$ ]] &&
  ((10#${BASH_REMATCH[2]:-0} * 86400 + 10#${BASH_REMATCH[4]:-0} * 3600 + 10#${BASH_REMATCH[5]} * 60 + 10#${BASH_REMATCH[6]} <= 300)); then
  echo "distsetup: job $SLURM_JOB_ID's time limit, $JOB_TIME_LIMIT, is not longer than the 300 s warning this script asks SLURM for before it: every run would be warned as it starts and requeued, without end. Submit it with a longer sbatch --time, or regenerate it with a shorter --signal_seconds." >&2
  exit 1
fi
# Preemption: SLURM sends USR1 to this shell before the time limit (--signal=B:USR1), set up from here on. Ask the
# training processes to checkpoint with SIGTERM (torchrun forwards TERM, not USR1), wait, then requeue the job;
# the next run resumes from the newest complete checkpoint.
SRUN_PID=""
terminated=0  # SLURM sent SIGTERM to this shell: it requeues or ends the job itself
# shellcheck disable=SC2317  # run by the trap below
forward_preemption() {
  trap "" USR1  # once
  if [[ -n "$SRUN_PID" ]] && ! kill -0 "$SRUN_PID" 2>/dev/null; then
    return 0  # srun has ended: the job ends as it did
  fi
  echo "distsetup: preemption signal: asking the training processes to checkpoint" >&2
  if ! scancel --signal=TERM "$SLURM_JOB_ID"; then  # the job steps, not this shell
    echo "distsetup: warning: scancel failed: signalling srun, which passes SIGTERM on to the processes" >&2
    [[ -z "$SRUN_PID" ]] || kill -TERM "$SRUN_PID" 2>/dev/null || true
  fi
  wait_for_srun
  if ((!terminated)); then
    echo "distsetup: requeueing job $SLURM_JOB_ID" >&2
    scontrol requeue "$SLURM_JOB_ID"
  fi
  exit 0
}
# srun's status once it has ended: a signal to this shell ends a wait, not srun
wait_for_srun() {
  [[ -n "$SRUN_PID" ]] || return 0  # signalled before srun started
  status=0
  wait "$SRUN_PID" || status=$?
  while kill -0 "$SRUN_PID" 2>/dev/null; do  # a signal ended the wait, not srun: wait for it
    status=0
    wait "$SRUN_PID" || status=$?
  done
}
trap forward_preemption USR1

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
TRAIN_ARGS=(--config config.yaml distributed.backend=deepspeed --deepspeed config/ds_config.json)

# --- environment ---
cd "$WORKDIR" || { echo "distsetup: cannot enter $WORKDIR (where this script was written): regenerate it in the project folder or edit WORKDIR" >&2; exit 1; }
module load cuda/12.4
eval "$(conda shell.bash hook)"
set +u  # conda's activate scripts read unset variables
conda activate train
set -u
# export OMP_NUM_THREADS=1  # CPU threads per process (the deepspeed launcher leaves it unset: each process then takes every core)
# export NCCL_DEBUG=INFO  # NCCL logging: WARN, INFO (connection set-up), TRACE
# export NCCL_SOCKET_IFNAME=eth0  # network interface NCCL uses between nodes
# export NCCL_IB_DISABLE=1  # 1 = no InfiniBand (use TCP sockets)
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=2  # a collective that times out raises in each rank, which says so, instead of hanging (1, 3: NCCL ends it)
# export CUDA_DEVICE_MAX_CONNECTIONS=1  # 1 lets tensor-parallel compute and communication overlap

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
echo "distsetup: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: $NNODES node(s) x $NPROC_PER_NODE = $((NNODES * NPROC_PER_NODE)) process(es), master $MASTER_ADDR:$MASTER_PORT" >&2
# --export=ALL: the variables above reach the nodes also where sbatch ran with --export=NONE (a site's SBATCH_EXPORT)
SRUN_ARGS=(--nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --export=ALL)
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
  SRUN_ARGS+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")  # srun does not inherit it from sbatch
fi
# A preemption of the job steps is said here: by each rank that stops for one with its checkpoint written, whatever
# sent the signal (a USR1 or SIGTERM to the job steps as well), and by node 0's program when it gets a USR1 (the
# ranks may still be setting up). A run that did not end well is then requeued. Node 0 runs this shell too.
export DISTSETUP_PREEMPTED_FILE="${TMPDIR:-/tmp}/distsetup-preempted-$SLURM_JOB_ID"
rm -f "$DISTSETUP_PREEMPTED_FILE"  # a requeued job runs this script again
# SLURM sends SIGTERM to this shell too (scancel, scontrol requeue, the time limit): caught, so that it lives until
# srun ends, and srun, which relays what the training processes print, until they have checkpointed and said so.
trap "terminated=1" TERM
# The single-quoted program runs once per node; its $VARIABLES expand there, not here.
# shellcheck disable=SC2016
srun "${SRUN_ARGS[@]}" bash -c '
set -euo pipefail
NODE_RANK="$SLURM_NODEID"
# SLURM may send USR1 to every process of the job (scancel --signal=USR1, --signal=USR1@N without B:). This shell
# takes it from its first line: node 0 tells the batch shell, which runs there, and a requeueing job is requeued
# whatever its ranks had done (during their set-up they die of it, leaving no checkpoint and no word of it).
# The deepspeed launcher dies of it; the ranks, in its process group, get it too: those training checkpoint and
# stop (the trainer takes it as SIGTERM), and this shell waits for them.
usr1_received=0
step_ending=0  # a SIGTERM came: SLURM ends the step (trapped so from the launch on)
# shellcheck disable=SC2317  # run by the trap below
take_preemption_notice() {
  usr1_received=1
  if [[ -n "${DISTSETUP_PREEMPTED_FILE:-}" ]] && ((NODE_RANK == 0)); then
    : >"$DISTSETUP_PREEMPTED_FILE"
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
HOSTFILE="${TMPDIR:-/tmp}/distsetup-hostfile-$SLURM_JOB_ID-$NODE_RANK"
scontrol show hostnames "$SLURM_JOB_NODELIST" | while read -r host; do
  echo "$host slots=$NPROC_PER_NODE"
done >"$HOSTFILE"
LAUNCH=(deepspeed --hostfile "$HOSTFILE" --no_ssh --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
echo "distsetup: preflight: all-reduce and barrier across the world before training" >&2
"${LAUNCH[@]}" --no_local_rank --module distsetup.preflight || end_node_program "$?"
# The process of the deepspeed launcher (runner.py) has a SIGTERM handler only with pdsh: SIGTERM ends it alone,
# while the launch.py it started (which has one: it stops the ranks, SIGKILL 30 s later) and the ranks go on. So
# this shell starts it as a child rather than becoming it, and ends with it and what it started.
if ((usr1_received)); then  # a preemption notice before the launcher had started, which it would never get
  end_node_program 138
fi
"${LAUNCH[@]}" --module "$MODULE" "$@" &
RUNNER_PID=$!
# SLURM signals every process of the job: caught, not ignored, so that the launcher keeps the default
trap "step_ending=1" TERM
# The processes of this task (its own process group) other than this shell: launch.py and the ranks, which outlive
# a runner.py that SIGTERM ended (SLURM kills the rest of a step once its task ends).
others_left() {
  local stat line fields
  for stat in /proc/[0-9]*/stat; do
    read -r line <"$stat" 2>/dev/null || continue
    read -r -a fields <<<"${line##*) }"  # after the command name: state, parent, process group
    [[ "${fields[2]}" == "$$" && "${stat//[^0-9]/}" != "$$" ]] && return 0
  done
  return 1
}
status=0
wait "$RUNNER_PID" || status=$?
while kill -0 "$RUNNER_PID" 2>/dev/null; do  # a signal ended the wait, not the launcher: wait for it
  status=0
  wait "$RUNNER_PID" || status=$?
done
while others_left; do
  sleep 1
done
end_node_program "$status"
' distsetup-node "${TRAIN_ARGS[@]}" "$@" &
SRUN_PID=$!
wait_for_srun
if ((!terminated && status != 0)) && [[ -e "$DISTSETUP_PREEMPTED_FILE" ]]; then  # a run that ended well stays so
  echo "distsetup: preempted: requeueing job $SLURM_JOB_ID (it resumes from its last checkpoint)" >&2
  rm -f "$DISTSETUP_PREEMPTED_FILE"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
