"""A throwaway single-node SLURM cluster for tests, run as root in a temporary directory.

:func:`start_cluster` writes a ``slurm.conf`` (no munge: ``auth/none``, ``cred/none``;
no cgroups: ``proctrack/linuxproc``, ``task/none``; this host as controller and only
node, with all its CPUs; free ports), starts ``slurmctld -D`` and ``slurmd -D`` in the
background and waits until ``sinfo`` shows the node idle. Commands reach it through
``SLURM_CONF`` (:attr:`SlurmCluster.env`), never through the machine's own SLURM
configuration. :meth:`SlurmCluster.stop` cancels the jobs and ends every process that
carries this cluster's ``SLURM_CONF``: the daemons, and the job processes, which
``slurmstepd`` detaches from ``slurmd``.

:class:`ClusterUnavailable` says why a cluster could not be had (SLURM not installed,
not root, the daemons did not come up in time, with the tail of their logs), for a
test to skip with.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from tests.support.launch_util import job_env, kill_tree

DAEMONS = ("slurmctld", "slurmd")
COMMANDS = ("sbatch", "scontrol", "scancel", "sinfo", "squeue", *DAEMONS)


class ClusterUnavailable(Exception):
    """No cluster could be started here; the message says why."""


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _conf_text(root: Path, host: str, ctld_port: int, slurmd_port: int) -> str:
    return f"""\
ClusterName=distckpt-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/none
CredType=cred/none
# A requeued job waits cred_expire seconds (default 120) before it may start again, and
# slurmd refuses to relaunch it before then ("Job credential revoked").
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
# Start a requeued job as soon as it is eligible (the defaults look every 30-60 s).
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MinJobAge=30
KillWait=10
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """A running cluster: its directory, its configuration and commands against it."""

    def __init__(self, root: Path, host: str) -> None:
        self.root = root
        self.host = host
        self.conf = root / "slurm.conf"
        # the test process's own SLURM job, if any, must not leak into this cluster's jobs
        base = {k: v for k, v in job_env().items() if not k.startswith(("SLURM_", "SBATCH_"))}
        self.env: dict[str, str] = {**base, "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen[str]] = []

    def run(
        self, *cmd: str, timeout: float = 15, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a SLURM command (``sbatch``, ``scontrol`` ...) against this cluster."""
        return subprocess.run(
            list(cmd),
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    def check(self, *cmd: str, timeout: float = 15) -> str:
        """Run a SLURM command that must succeed; return its stdout."""
        proc = self.run(*cmd, timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} exited with {proc.returncode}\n{proc.stdout}{proc.stderr}"
                f"\n{self.logs()}"
            )
        return proc.stdout

    def submit(self, *args: str, env: Mapping[str, str] | None = None) -> str:
        """``sbatch --parsable ARGS`` with this cluster's environment plus ``env``; the id."""
        proc = self.run("sbatch", "--parsable", *args, env=env)
        if proc.returncode != 0:
            raise AssertionError(f"sbatch {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``Restarts``, ``ExitCode`` ...);
        empty once the controller forgot the job.
        """
        proc = self.run("scontrol", "show", "job", "--oneliner", job_id)
        if proc.returncode != 0:
            return {}
        fields: dict[str, str] = {}
        for word in proc.stdout.split():
            key, sep, value = word.partition("=")
            if sep:
                fields[key] = value
        return fields

    def wait_job(
        self,
        job_id: str,
        until: Callable[[dict[str, str]], bool],
        timeout: float,
        what: str,
    ) -> dict[str, str]:
        """Poll the job until ``until(fields)`` holds; AssertionError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if until(fields):
                return fields
            time.sleep(0.2)
        raise AssertionError(
            f"job {job_id}: not {what} within {timeout} s; last seen {fields}\n{self.logs()}"
        )

    def logs(self, lines: int = 30) -> str:
        """The last lines of the daemons' logs, for failure messages."""
        parts = []
        for log in sorted((self.root / "log").glob("*")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name} ---\n" + "\n".join(text))
        return "\n".join(parts)

    def _our_processes(self) -> list[int]:
        """Processes (not this one) whose environment holds this cluster's SLURM_CONF."""
        token = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if token in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
        return found

    def stop(self) -> None:
        """Cancel every job, stop the daemons, end whatever processes of ours remain."""
        with contextlib.suppress(Exception):
            self.run("scancel", "--user", "root", timeout=5)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and self.run("squeue", "-h", timeout=5).stdout:
                time.sleep(0.2)
        for proc in self.daemons:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in self.daemons:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                kill_tree(proc)
                proc.wait(timeout=5)
        for pid in self._our_processes():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def start_cluster(root: Path, timeout: float = 30) -> SlurmCluster:
    """Start a one-node cluster in ``root``; raise :class:`ClusterUnavailable` if none."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        raise ClusterUnavailable(
            f"SLURM not installed ({', '.join(missing)} missing; apt-get install slurm-wlm)"
        )
    if os.geteuid() != 0:
        raise ClusterUnavailable("the test SLURM cluster runs its daemons as root; not root")
    host = socket.gethostname().split(".")[0]
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    cluster = SlurmCluster(root, host)
    cluster.conf.write_text(_conf_text(root, host, *_free_ports(2)))
    for daemon in DAEMONS:
        out = open(root / "log" / f"{daemon}.out", "w")  # noqa: SIM115 (the daemon keeps it)
        cluster.daemons.append(
            subprocess.Popen(
                [daemon, "-D", "-f", str(cluster.conf)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=cluster.env,
                cwd=root,
                start_new_session=True,
                text=True,
            )
        )
        out.close()
    deadline = time.monotonic() + timeout
    state = ""
    why = f"node {host} not idle within {timeout} s"
    while time.monotonic() < deadline:
        exited = [
            (n, p.returncode) for n, p in zip(DAEMONS, cluster.daemons) if p.poll() is not None
        ]
        if exited:
            why = f"{exited[0][0]} exited with {exited[0][1]}"
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            state = cluster.run("sinfo", "--noheader", "--format=%T", timeout=5).stdout.strip()
        if state == "idle":
            return cluster
        time.sleep(0.25)
    cluster.stop()
    raise ClusterUnavailable(
        f"the SLURM daemons did not start: {why} (sinfo: {state or 'no answer'})\n"
        f"{cluster.logs(15)}"
    )
