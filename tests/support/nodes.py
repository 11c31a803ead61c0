"""Two real "nodes" on this machine, for tests/cluster/test_two_nodes.py.

A node is a holder process made by ``unshare --net --uts --mount --pid --fork``: its own
network namespace (``lo`` up, and ``eth0``, one end of a veth pair whose other end is
plugged into a bridge in a third namespace, the switch, so that losing one node leaves
the other's link up, as on a real network; addresses :data:`ADDRESSES`), its own host
name (UTS namespace), its own ``/dev/shm`` (a fresh tmpfs in its private mount namespace) and its
own ``/etc/hosts`` naming both nodes (a bind mount in that namespace), and its own PID
namespace, whose init is the holder's child. Commands run in a node through
:meth:`Node.command` (``nsenter`` into all of it); everything else on the machine
(the file system, ``/proc``, the repository, ``sys.executable``) is shared, so the
persistent checkpoint directory is one both nodes see, while each node's ``/dev/shm``
is its own.

:meth:`Node.kill` SIGKILLs the holder: the PID namespace's init dies with it (``unshare
--kill-child``), the kernel kills every process in that namespace, and once none is
left the mount namespace and its tmpfs, and the network namespace and its veth pair,
are gone. :meth:`Node.link` takes ``eth0`` down or up from the outside.

``/proc`` is not remounted inside a node: it stays the machine's, so a launcher running
in node A (in A's network, UTS and mount namespaces, but the machine's PID namespace:
a process cannot enter a sibling PID namespace) can still ``nsenter`` node B by its
holder's PID (see ``tests/scripts/node_ssh.sh``, hydra's ``-launcher-exec``).

:func:`two_nodes` makes the switch and both nodes and always takes them down (holders,
veth pairs, mounts), on any failure. :func:`unavailable` says why nodes cannot be made
here (not root, a missing command, ``unshare`` refused), for a test to skip with.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.launch_util import MPIEXEC, REPO_ROOT, SCRIPTS, kill_tree, start

#: The nodes' host names and their addresses on the veth link (a /24 of their own: the
#: link exists only between the two namespaces, never on the machine's network).
NAMES = ("dckpt-node-a", "dckpt-node-b")
ADDRESSES = ("10.231.0.1", "10.231.0.2")
PREFIX = 24
IFACE = "eth0"  # the veth end's name inside each node
BRIDGE = "br0"  # the bridge in the switch's namespace
COMMANDS = ("unshare", "nsenter", "ip", "mount", "hostname")
TIMEOUT = 20.0  # seconds for each setup or teardown command
PR_SET_PDEATHSIG = 1  # prctl(2)


class NodesUnavailable(Exception):
    """Nodes cannot be made here; the message says why."""


def unavailable() -> str | None:
    """Why :func:`two_nodes` cannot work here, or None when it may."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "making network, UTS, mount and PID namespaces needs root"
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return f"{', '.join(missing)} not found (Debian: iproute2, util-linux)"
    probe = subprocess.run(
        ["unshare", "--net", "--uts", "--mount", "--pid", "--fork", "true"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    if probe.returncode != 0:
        return f"unshare cannot make namespaces here: {probe.stderr.strip()}"
    return None


def _run(cmd: Sequence[str], timeout: float = TIMEOUT) -> str:
    """Run a setup command; its stdout. Raises NodesUnavailable with its output."""
    try:
        proc = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise NodesUnavailable(f"{' '.join(cmd)} took more than {timeout} s") from None
    if proc.returncode != 0:
        raise NodesUnavailable(
            f"{' '.join(cmd)} exited with {proc.returncode}: {proc.stderr.strip()}"
        )
    return proc.stdout


@dataclass
class Node:
    """One node: its name, address, and the holder process keeping its namespaces."""

    name: str
    address: str
    holder: subprocess.Popen[str]
    init: int  # the PID namespace's init (the holder's child), by the machine's PID
    dead: bool = False

    def command(self, argv: Sequence[str], *, pid: bool = True, cwd: Path = REPO_ROOT) -> list[str]:
        """``argv`` run inside this node, in ``cwd`` (``pid=False``: not in its PID
        namespace, so that it may enter the other node's, as a launcher must)."""
        spaces = ["--net", "--uts", "--mount"] + (["--pid"] if pid else [])
        return ["nsenter", "--target", str(self.init), *spaces, f"--wd={cwd}", "--", *argv]

    def run(self, argv: Sequence[str], timeout: float = TIMEOUT) -> str:
        """Run ``argv`` inside the node, bounded; its stdout (raises on failure)."""
        return _run(self.command(argv), timeout)

    @property
    def root(self) -> Path:
        """The node's file system as its processes see it (its /dev/shm under it)."""
        return Path(f"/proc/{self.init}/root")

    @property
    def shm(self) -> Path:
        return self.root / "dev" / "shm"

    def link(self, up: bool) -> None:
        """Bring this node's ``eth0`` up or down (from outside: an event the node's
        processes do not take part in)."""
        self.run(["ip", "link", "set", IFACE, "up" if up else "down"])

    def kill(self) -> None:
        """The node is lost: every process in it SIGKILLed, its /dev/shm gone. Returns
        once the init of its PID namespace has exited (so every process in it has)."""
        if self.dead:
            return
        self.dead = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.holder.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.holder.wait(timeout=TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while _running(self.init) and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.init, signal.SIGKILL)
            time.sleep(0.01)  # the kernel takes the namespace down: nothing to wait on
        if _running(self.init):
            raise NodesUnavailable(f"node {self.name}: its init {self.init} outlived SIGKILL")


def _running(pid: int) -> bool:
    """Whether ``pid`` has not exited. A PID namespace's init becomes a zombie only once
    every other process of its namespace is gone (and with them its mounts); the
    machine's init may take a while to reap it, which need not be waited for."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] not in {"Z", "X"}


def _die_with_parent() -> None:
    """In the holder before it runs: SIGKILL it if the test process dies (a node never
    outlives the test session, even one killed without its teardown)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _holder(name: str, setup: str) -> tuple[subprocess.Popen[str], int]:
    """Start a holder that runs ``setup`` (shell) in its new namespaces; returns it and
    its child (the PID namespace's init) once the child has done so and said so."""
    script = f"set -e; {setup}; echo ready; exec sleep 86400"
    holder = subprocess.Popen(
        [
            "unshare",
            "--net",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "--pid",
            "--fork",
            "--kill-child",
            "sh",
            "-c",
            script,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    assert holder.stdout is not None
    ready, _, _ = select.select([holder.stdout], [], [], TIMEOUT)
    line = holder.stdout.readline() if ready else ""
    if line.strip() != "ready":
        kill_tree(holder)
        err = holder.stderr.read() if holder.stderr is not None else ""
        raise NodesUnavailable(f"node {name} did not come up: {line!r} {err.strip()}")
    children = Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text().split()
    if len(children) != 1:
        kill_tree(holder)
        raise NodesUnavailable(f"node {name}: the holder has children {children}")
    return holder, int(children[0])


class Bed:
    """Nodes A and B (:attr:`a`, :attr:`b`), each linked by a veth pair to a bridge in a
    namespace of its own (:attr:`switch`); see :func:`two_nodes`."""

    a: Node
    b: Node
    switch: Node

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.hosts = workdir / "hosts"
        self.hosts.write_text(
            "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(ADDRESSES, NAMES))
        )
        self.made: list[Node] = []  # every node ever made, for the teardown
        self._ends: list[str] = []  # every veth end ever made on the machine
        self.jobs: list[subprocess.Popen[str]] = []  # every job started by the methods

    def up(self) -> None:
        """Make the switch, and nodes A and B plugged into it."""
        self.switch = self._switch()
        self.a = self._node(0)
        self.b = self._node(1)

    def _node(self, i: int) -> Node:
        name = NAMES[i]
        holder, init = _holder(
            name,
            "mount -t tmpfs -o size=1g,mode=1777 dckpt-shm /dev/shm; "
            f"mount --bind {self.hosts} /etc/hosts; hostname {name}; ip link set lo up",
        )
        node = Node(name, ADDRESSES[i], holder, init)
        self.made.append(node)
        self._plug(node)
        return node

    def _switch(self) -> Node:
        """The switch: a namespace holding a bridge the nodes' links are plugged into,
        so that losing one node leaves the other's link up, as on a real network."""
        holder, init = _holder(
            "switch", f"ip link add {BRIDGE} type bridge; ip link set {BRIDGE} up"
        )
        switch = Node("switch", "", holder, init)
        self.made.append(switch)
        return switch

    def _plug(self, node: Node) -> None:
        """A veth pair from ``node`` (its ``eth0``) to the switch's bridge."""
        # names on the machine until moved into the namespaces (at most 15 characters)
        tag = f"dk{os.getpid() % 100_000}{len(self._ends) // 2}"
        ends = [f"{tag}n", f"{tag}s"]
        self._ends += ends
        _run(["ip", "link", "add", ends[0], "type", "veth", "peer", "name", ends[1]])
        _run(["ip", "link", "set", ends[0], "netns", str(node.init)])
        _run(["ip", "link", "set", ends[1], "netns", str(self.switch.init)])
        self.switch.run(["ip", "link", "set", ends[1], "master", BRIDGE])
        self.switch.run(["ip", "link", "set", ends[1], "up"])
        node.run(["ip", "link", "set", ends[0], "name", IFACE])
        node.run(["ip", "addr", "add", f"{node.address}/{PREFIX}", "dev", IFACE])
        node.run(["ip", "link", "set", IFACE, "up"])

    def replace_b(self) -> Node:
        """A fresh node B, after the old one was lost (:meth:`Node.kill`): the same name
        and address, an empty /dev/shm, a new link to the switch."""
        assert self.b.dead, "replace a node once it is lost"
        self.b = self._node(1)
        return self.b

    def torchrun(
        self,
        ranks_of: Sequence[Node],
        script: Path,
        *args: str,
        env: Mapping[str, str] | None = None,
    ) -> list[subprocess.Popen[str]]:
        """:func:`torchrun`, its agents killed (with all they started) by :meth:`close`."""
        procs = torchrun(ranks_of, script, *args, env=env)
        self.jobs += procs
        return procs

    def mpiexec(
        self, script: Path, *args: str, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """:func:`mpiexec` on A and B, killed (with all it started) by :meth:`close`."""
        proc = mpiexec(self.a, self.b, script, *args, env=env)
        self.jobs.append(proc)
        return proc

    def close(self) -> None:
        """Kill every job still running and every node made, delete any veth end never
        moved into one."""
        for job in self.jobs:
            if job.poll() is None:
                kill_tree(job)
        errors = []
        for node in self.made:
            try:
                node.kill()
            except NodesUnavailable as exc:
                errors.append(exc)
        for end in self._ends:
            with contextlib.suppress(Exception):
                if Path(f"/sys/class/net/{end}").exists():
                    _run(["ip", "link", "del", end])
        if errors:
            raise errors[0]


@contextlib.contextmanager
def two_nodes(workdir: Path) -> Iterator[Bed]:
    """A :class:`Bed` of nodes A and B; every node and link taken down however the block
    ends (and if making them fails half way)."""
    bed = Bed(workdir)
    try:
        bed.up()
        yield bed
    finally:
        bed.close()


def reachable(a: Node, b: Node) -> bool:
    """``a`` reaches ``b``'s address over the link (a TCP connect attempt from inside
    ``a`` to a port nobody listens on is answered by a reset: reachable)."""
    probe = (
        "import socket,sys\n"
        "s=socket.socket(); s.settimeout(2)\n"
        "try:\n s.connect((sys.argv[1], 9)); print('open')\n"
        "except ConnectionRefusedError: print('refused')\n"
        "except OSError as e: print('unreachable', e)\n"
    )
    out = a.run([sys.executable, "-c", probe, b.address])
    return out.split()[0] in {"open", "refused"}


def node_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a job in a node gets on top of :func:`launch_util.job_env`: gloo on the
    veth, and no node name from the environment (the host name says it)."""
    return {"GLOO_SOCKET_IFNAME": IFACE, **(extra or {})}


# ---------------------------------------------------------------- jobs across the nodes

#: MPICH's UCX netmod inside the nodes: shared memory by file name in the node's own
#: /dev/shm (not /proc/<pid>/fd links: PIDs differ between a node's namespace and the
#: machine's /proc), TCP on the veth between nodes; no cross-memory attach (it needs
#: PIDs too).
MPI_ENV = {
    "UCX_TLS": "posix,tcp,self",
    "UCX_POSIX_USE_PROC_LINK": "n",
    "UCX_NET_DEVICES": IFACE,
}
LAUNCHER = SCRIPTS / "node_ssh.sh"
_ports = iter(range(29400, 29900))


def _no_node_names(argv: Sequence[str]) -> list[str]:
    """``argv`` with no variable that would name the node (the host name must)."""
    unset = sorted(k for k in os.environ if k == "DISTCKPT_NODE" or k.startswith("SLURM_"))
    return ["env", *(f"--unset={k}" for k in unset), *argv]


def torchrun(
    ranks_of: Sequence[Node], script: Path, *args: str, env: Mapping[str, str] | None = None
) -> list[subprocess.Popen[str]]:
    """One torchrun agent per node (2 ranks each), joined by c10d rendezvous on the first
    node's address; collect each with :func:`launch_util.finish`."""
    endpoint = f"{ranks_of[0].name}:{next(_ports)}"
    procs = []
    for node in ranks_of:
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(len(ranks_of)),
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            "two-nodes",
            str(script),
            *args,
        ]
        procs.append(start(node.command(_no_node_names(argv)), node_env(env)))
    return procs


def mpiexec(
    a: Node, b: Node, script: Path, *args: str, env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    """MPICH's hydra in node A (its network, UTS and mount namespaces) with 2 ranks on
    each node; the proxy on B started by :data:`LAUNCHER` in place of ssh. Hydra forks
    the proxy of its own host itself: A's ranks run in the machine's PID namespace (B's
    in B's), which a kill of node A would not reach."""
    assert MPIEXEC is not None
    argv = [
        MPIEXEC,
        "-hosts",
        f"{a.name}:2,{b.name}:2",
        "-n",
        "4",
        "-launcher",
        "ssh",
        "-launcher-exec",
        str(LAUNCHER),
        "-iface",
        IFACE,
        sys.executable,
        str(script),
        *args,
    ]
    pids = f"{a.name}={a.init} {b.name}={b.init}"
    extra = {**MPI_ENV, "DCKPT_NODE_PIDS": pids, **(env or {})}
    return start(a.command(_no_node_names(argv), pid=False), node_env(extra))
