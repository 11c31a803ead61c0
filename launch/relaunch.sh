#!/usr/bin/env bash
# Run a launch script again and again while the job reports preemption (exit code 75),
# with a number of processes chosen anew before every attempt: elastic resume, each
# attempt restoring the newest checkpoint onto its own world size.
#
#   NPROCS_SEQUENCE="4 2 3" RUN_DIR=run launch/relaunch.sh --steps 100
#   NPROCS_COMMAND="scripts/free_gpus" LAUNCHER=launch/torchrun.sh launch/relaunch.sh
#
# Variables (all optional; the launcher's own, RUN_DIR, TRAIN_SCRIPT, PYTHON, ..., pass
# through to it):
#   LAUNCHER         the launch script to run (default: mpirun.sh beside this script)
#   MAX_ATTEMPTS     give up after this many attempts (default: 10)
#   NPROCS_COMMAND   a command whose output (one number) is NPROCS for the next attempt,
#                    e.g. one that counts the free GPUs; run by bash -c before every
#                    attempt
#   NPROCS_SEQUENCE  NPROCS for attempts 1, 2, 3, ...; the last value repeats
#                    (used when NPROCS_COMMAND is not set)
#   NPROCS           used when neither is set (else the launcher's default)
#   RELAUNCH_DELAY   seconds to wait between attempts (default: 0)
#   RELAUNCH_ON_FAILURE  set to 1 to relaunch also after a failure (any exit code but 0),
#                    as after a lost node: with a distckpt.LocalTier the next attempt
#                    resumes from the newest local step the surviving nodes hold
# Arguments: passed to the launcher, which passes them to the training script.
#
# Exit code: 0 once an attempt finishes normally; the code of the first attempt that
# fails for any other reason than preemption (it is not retried, unless
# RELAUNCH_ON_FAILURE=1; then the code of the last attempt when all MAX_ATTEMPTS ended
# without success); 75 when MAX_ATTEMPTS attempts were all preempted, or when this script itself got SIGTERM or SIGUSR1 (it is
# forwarded to the running attempt, and no further attempt starts), so that whatever
# runs this script can requeue it.
set -euo pipefail

HERE="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$HERE/common.sh"

LAUNCHER="${LAUNCHER:-$HERE/mpirun.sh}"
MAX_ATTEMPTS="${MAX_ATTEMPTS:-10}"
NPROCS_COMMAND="${NPROCS_COMMAND:-}"
read -r -a sequence <<<"${NPROCS_SEQUENCE:-}"
RELAUNCH_DELAY="${RELAUNCH_DELAY:-0}"
RELAUNCH_ON_FAILURE="${RELAUNCH_ON_FAILURE:-0}"

# nprocs_for ATTEMPT: print NPROCS for attempt ATTEMPT (1-based); nothing: launcher's default
nprocs_for() {
    local attempt=$1 n
    if [[ -n "$NPROCS_COMMAND" ]]; then
        n="$(bash -c "$NPROCS_COMMAND")"
        n="${n//[[:space:]]/}"
        if ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then
            log "NPROCS_COMMAND printed '$n', not a number of processes"
            return 1
        fi
        echo "$n"
    elif ((${#sequence[@]} > 0)); then
        local i=$((attempt - 1))
        ((i < ${#sequence[@]})) || i=$((${#sequence[@]} - 1))
        echo "${sequence[$i]}"
    else
        echo "${NPROCS:-}"
    fi
}

stopping=""
launcher_pid=""
# shellcheck disable=SC2317  # called by the traps below
forward() {
    stopping="SIG$1"
    if [[ -n "$launcher_pid" ]]; then
        log "got SIG$1; forwarding it to attempt $attempt (pid $launcher_pid)"
        kill -s "$1" "$launcher_pid" 2>/dev/null || true
    fi
}
trap 'forward TERM' TERM
trap 'forward USR1' USR1

attempt=0
last_failure=""
while ((attempt < MAX_ATTEMPTS)); do
    if [[ -n "$stopping" ]]; then
        log "got $stopping between attempts; not relaunching"
        exit "$EXIT_PREEMPTED"
    fi
    attempt=$((attempt + 1))
    nprocs="$(nprocs_for "$attempt")"
    log "attempt $attempt of $MAX_ATTEMPTS: NPROCS=${nprocs:-default} $LAUNCHER $*"
    if [[ -n "$nprocs" ]]; then
        NPROCS="$nprocs" "$LAUNCHER" "$@" &
    else
        "$LAUNCHER" "$@" &
    fi
    launcher_pid=$!
    rc=0
    wait_for "$launcher_pid" || rc=$?
    launcher_pid=""
    if ((rc == 0)); then
        log "attempt $attempt finished"
        exit 0
    fi
    if ((rc != EXIT_PREEMPTED)); then
        if [[ "$RELAUNCH_ON_FAILURE" != 1 || -n "$stopping" ]]; then
            log "attempt $attempt failed with exit code $rc; not relaunching"
            exit "$rc"
        fi
        last_failure=$rc
        log "attempt $attempt failed with exit code $rc; relaunching (RELAUNCH_ON_FAILURE=1)"
    elif [[ -n "$stopping" ]]; then
        log "attempt $attempt preempted by $stopping sent to ${0##*/}; not relaunching"
        exit "$EXIT_PREEMPTED"
    else
        log "attempt $attempt preempted"
    fi
    if ((attempt < MAX_ATTEMPTS)) && [[ "$RELAUNCH_DELAY" != 0 ]]; then
        sleep "$RELAUNCH_DELAY" &
        wait_for $! || true
    fi
done
if [[ -n "$last_failure" ]]; then
    log "no attempt of $MAX_ATTEMPTS succeeded; giving up"
    exit "$last_failure"
fi
log "all $MAX_ATTEMPTS attempts were preempted; giving up"
exit "$EXIT_PREEMPTED"
