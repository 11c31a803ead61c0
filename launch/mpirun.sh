#!/usr/bin/env bash
# Run a distckpt training script under MPI: mpiexec -n NPROCS PYTHON TRAIN_SCRIPT --dir RUN_DIR "$@"
#
#   NPROCS=4 RUN_DIR=run launch/mpirun.sh --steps 100 --every 10
#
# Variables (all optional):
#   NPROCS          number of ranks (default: SLURM_NTASKS inside a SLURM job, else 2)
#   RUN_DIR         checkpoint directory, passed as --dir (default: run)
#   TRAIN_SCRIPT    the training script (default: examples/train_sharded.py of this repo)
#   PYTHON          interpreter for the ranks (default: python3)
#   MPIEXEC         the MPI launcher (default: mpiexec)
#   MPIEXEC_ARGS    more mpiexec options, split on spaces (e.g. "-ppn 4 -hosts a,b")
#   DISTCKPT_PREEMPTED_FILE
#                   where rank 0 reports a preemption (default: RUN_DIR/preempted.json);
#                   removed before the launch
# Arguments: passed to the training script after --dir RUN_DIR.
#
# SIGTERM or SIGUSR1 sent to this script is forwarded to mpiexec, which forwards it to
# every rank; the ranks save a final checkpoint and exit with 75.
# Exit code: 75 when the job was preempted (exit code 75, or the preempted file exists),
# else mpiexec's exit code (0 for a normal finish).
set -euo pipefail

HERE="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$HERE/common.sh"

NPROCS="${NPROCS:-${SLURM_NTASKS:-2}}"
MPIEXEC="${MPIEXEC:-mpiexec}"
read -r -a mpiexec_args <<<"${MPIEXEC_ARGS:-}"

prepare_preempted_file

# shellcheck disable=SC2317  # called by the traps below
forward() {
    log "got SIG$1; forwarding it to mpiexec (pid $launcher_pid)"
    kill -s "$1" "$launcher_pid" 2>/dev/null || true
}

log "$MPIEXEC -n $NPROCS ${mpiexec_args[*]} $PYTHON $TRAIN_SCRIPT --dir $RUN_DIR $*"
"$MPIEXEC" -n "$NPROCS" "${mpiexec_args[@]}" "$PYTHON" "$TRAIN_SCRIPT" --dir "$RUN_DIR" "$@" &
launcher_pid=$!
supervise mpiexec "$launcher_pid"
