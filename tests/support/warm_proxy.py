"""Stand in for one MPI rank: ``mpiexec -n N python warm_proxy.py SCRIPT ARGS...``.

Started by mpiexec as the rank's process, it imports nothing heavy: it hands its
environment (``PMI_RANK``, ``PMI_SIZE``, ...) and its descriptors (stdin, stdout,
stderr, and ``PMI_FD``, its connection to the MPI launcher) to the warm server of the
test session (``$TESTS_WARM_RANKS_SOCKET``, see ``tests/support/warm_ranks.py``),
which forks the real rank with them: that process initializes MPI over the same
connection, as the rank would have, and prints into the same pipes. The proxy passes on
the signals the launcher sends (SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGHUP) and ends as
the rank ended: with its exit status, or killed by the same signal. If the proxy is
killed, its connection closes and the rank is killed.
"""

import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def main() -> None:
    fds = [0, 1, 2]
    if os.environ.get("PMI_FD", "").isdigit():
        fds.append(int(os.environ["PMI_FD"]))
    request = {
        "mode": "proxy",
        "script": sys.argv[1],
        "args": sys.argv[2:],
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "fds": fds,
    }
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ["TESTS_WARM_RANKS_SOCKET"])
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)

    def forward(signum: int, frame: object) -> None:
        conn.sendall(json.dumps({"signal": signum}).encode() + b"\n")

    for sig in FORWARDED:
        signal.signal(sig, forward)
    answer: dict = {}
    with conn.makefile("rb") as lines:
        while "codes" not in answer:
            line = lines.readline()
            if not line:
                os._exit(1)
            answer = json.loads(line)
    (code,) = answer["codes"]
    if code < 0:
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
