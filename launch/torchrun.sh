#!/usr/bin/env bash
# Run a distckpt training script under torchrun:
#   torchrun --standalone --nproc-per-node NPROCS TRAIN_SCRIPT --dir RUN_DIR "$@"
#
#   NPROCS=4 RUN_DIR=run launch/torchrun.sh --steps 100 --every 10
#
# Variables (all optional):
#   NPROCS          workers on this node (default: 2)
#   RUN_DIR         checkpoint directory, passed as --dir (default: run)
#   TRAIN_SCRIPT    the training script (default: examples/train_sharded.py of this repo)
#   PYTHON          interpreter; torchrun is run as PYTHON -m torch.distributed.run
#                   (default: python3)
#   TORCHRUN_ARGS   more torchrun options, split on spaces
#   NNODES          nodes in the job (default: SLURM_JOB_NUM_NODES, else 1). Above 1,
#                   torchrun meets its peers with the c10d rendezvous instead of
#                   --standalone, at
#   RDZV_ENDPOINT   host:port (default: the first node of SLURM_JOB_NODELIST, port
#                   RDZV_PORT, default 29500), with
#   RDZV_ID         the job's id (default: SLURM_JOB_ID). Run one copy of this script per
#                   node, e.g. `srun --ntasks-per-node=1 launch/torchrun.sh`.
#   DISTCKPT_PREEMPTED_FILE
#                   where rank 0 reports a preemption (default: RUN_DIR/preempted.json);
#                   removed before the launch
# Arguments: passed to the training script after --dir RUN_DIR.
#
# SIGTERM or SIGUSR1 sent to this script goes straight to the workers (torchrun's own
# children): torchrun dies of SIGUSR1 without passing it on, and answers SIGTERM by
# killing its workers after 30 s, maybe in the middle of the final checkpoint.
# Exit code: 75 when the job was preempted (exit code 75, or the preempted file exists:
# torchrun reports any failed worker as 1), else torchrun's exit code.
set -euo pipefail

HERE="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$HERE/common.sh"

NPROCS="${NPROCS:-2}"
read -r -a torchrun_args <<<"${TORCHRUN_ARGS:-}"
NNODES="${NNODES:-${SLURM_JOB_NUM_NODES:-1}}"

if ((NNODES > 1)); then
    if [[ -z "${RDZV_ENDPOINT:-}" ]]; then
        nodes="${SLURM_JOB_NODELIST:?NNODES=$NNODES needs RDZV_ENDPOINT, or a SLURM job}"
        head_node="$(scontrol show hostnames "$nodes" | head -n 1)"
        RDZV_ENDPOINT="$head_node:${RDZV_PORT:-29500}"
    fi
    rendezvous=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
        --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-distckpt}}")
else
    rendezvous=(--standalone)
fi

prepare_preempted_file

# shellcheck disable=SC2317  # called by the traps below
forward() {
    log "got SIG$1; forwarding it to the workers of torchrun (pid $launcher_pid)"
    # the workers are torchrun's direct children; none yet: stop torchrun itself
    pkill "-$1" -P "$launcher_pid" || kill -s TERM "$launcher_pid" 2>/dev/null || true
}

cmd=("$PYTHON" -m torch.distributed.run "${rendezvous[@]}" --nproc-per-node "$NPROCS"
    "${torchrun_args[@]}" "$TRAIN_SCRIPT" --dir "$RUN_DIR" "$@")
log "${cmd[*]}"
"${cmd[@]}" &
launcher_pid=$!
supervise torchrun "$launcher_pid"
