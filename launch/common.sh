# shellcheck shell=bash
# Helpers sourced by the launch scripts; not run on its own.
#
# The preemption contract of a distckpt training job: a rank that receives SIGTERM or
# SIGUSR1 finishes its step, the ranks save a final checkpoint together, and every rank
# exits with 75 (EX_TEMPFAIL, distckpt.preemption.EXIT_PREEMPTED). Launchers may turn 75
# into another code (torchrun reports 1 for any failed worker), so rank 0 also writes
# the file named by DISTCKPT_PREEMPTED_FILE (JSON: step, checkpoint, signal) just before
# it exits. A launch script removes that file before starting the job, and reports 75
# when the job exited with 75 or left that file behind.

readonly EXIT_PREEMPTED=75

# The defaults every launch script shares (each documents them in its header).
LAUNCH_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
RUN_DIR="${RUN_DIR:-run}"
TRAIN_SCRIPT="${TRAIN_SCRIPT:-$(dirname -- "$LAUNCH_DIR")/examples/train_sharded.py}"
PYTHON="${PYTHON:-python3}"

log() {
    printf '%s [%s] %s\n' "$(date '+%F %T')" "${LOG_TAG:-${0##*/}}" "$*" >&2
}

# Set DISTCKPT_PREEMPTED_FILE (default: preempted.json in RUN_DIR), export it and remove
# a file left by an earlier attempt.
prepare_preempted_file() {
    export DISTCKPT_PREEMPTED_FILE="${DISTCKPT_PREEMPTED_FILE:-${RUN_DIR}/preempted.json}"
    mkdir -p -- "$(dirname -- "$DISTCKPT_PREEMPTED_FILE")"
    rm -f -- "$DISTCKPT_PREEMPTED_FILE"
}

# is_preempted RC: true when the job exited with 75 or rank 0 left the preempted file.
is_preempted() {
    [[ "$1" -eq "$EXIT_PREEMPTED" || -e "$DISTCKPT_PREEMPTED_FILE" ]]
}

# wait_for PID: wait until the background process PID has exited and return its exit
# code. A trapped signal makes `wait` return early (128 + signal number) while PID still
# runs; the trap has forwarded the signal by then, so wait again.
wait_for() {
    local pid=$1 rc
    while :; do
        rc=0
        wait "$pid" || rc=$?
        if ((rc > 128)) && kill -0 "$pid" 2>/dev/null; then
            continue # interrupted by a trapped signal; PID still running
        fi
        if ((rc > 128)); then
            # Gone now, but this status may be the interrupted wait's: ask bash for the
            # status it recorded for PID (127 when it has none).
            local again=0
            wait "$pid" 2>/dev/null || again=$?
            ((again == 127)) || rc=$again
        fi
        return "$rc"
    done
}

# supervise NAME PID: pass SIGTERM and SIGUSR1 on (through the caller's `forward SIG`),
# wait for the launcher PID, then exit with 75 if the job was preempted, else with its
# exit code.
supervise() {
    local name=$1 pid=$2 rc=0
    trap 'forward TERM' TERM
    trap 'forward USR1' USR1
    wait_for "$pid" || rc=$?
    if is_preempted "$rc"; then
        log "preempted ($name exited with $rc); exiting with $EXIT_PREEMPTED"
        exit "$EXIT_PREEMPTED"
    fi
    log "$name exited with $rc"
    exit "$rc"
}
