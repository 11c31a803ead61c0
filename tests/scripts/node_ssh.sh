#!/bin/sh
# hydra's -launcher-exec for the two nodes of tests/support/nodes.py, in place of ssh: hydra runs
#   node_ssh.sh -x HOST "PROXY" ARGS...
# (a command line for a remote shell, as ssh takes it); this runs that line inside the
# node named HOST: nsenter into its network, UTS, mount and PID namespaces, by the PID
# that $DCKPT_NODE_PIDS gives for it ("name=pid name=pid"). Any other host is refused.
set -eu
[ "${1:-}" = "-x" ] && shift
host=$1
shift
pid=
for pair in ${DCKPT_NODE_PIDS:?DCKPT_NODE_PIDS is not set}; do
    [ "${pair%%=*}" = "$host" ] && pid=${pair#*=}
done
if [ -z "$pid" ]; then
    echo "node_ssh.sh: $host is not one of the test's nodes ($DCKPT_NODE_PIDS)" >&2
    exit 255
fi
exec nsenter --target "$pid" --net --uts --mount --pid --wd="$PWD" -- sh -c "$*"
