"""Two torchrun agents on loopback as two nodes, each with its own local disk.

Each agent runs in its own mount namespace, where this node's directory is bound at the one
``local_dir`` path every node uses (as each real node has its own disk at, e.g., /dev/shm/run1).
Killing a node SIGKILLs its agent and every process below it (torchrun starts each worker in a
session of its own, so the agent's process group alone would miss them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "train_replicated.py"
REPO = HERE.parents[2]


def can_isolate_nodes() -> bool:
    """Whether this machine lets us give each node its own mount and PID namespace (root, unshare)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Job:
    """One 2-node job: ``root/local`` is the shared path, ``root/node<i>`` each node's own disk."""

    def __init__(self, root: Path, out: Path, steps: int, *, nproc: int = 2, extra: tuple[str, ...] = ()) -> None:
        self.root, self.out, self.steps, self.nproc, self.extra = root, out, steps, nproc, extra
        self.port = free_port()
        self.rdzv = uuid.uuid4().hex[:12]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        (root / "local").mkdir(parents=True, exist_ok=True)
        out.mkdir(parents=True, exist_ok=True)

    def node_dir(self, node: int) -> Path:
        return self.root / f"node{node}"

    def start(self) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "plugins" / "checkpoint-manager-tiered" / "src")]),
            "OMP_NUM_THREADS": "1",
        }
        for node in (0, 1):
            self.node_dir(node).mkdir(parents=True, exist_ok=True)
            torchrun = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes=2", f"--node-rank={node}", f"--nproc-per-node={self.nproc}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.rdzv}",
                "--max-restarts=0", "--monitor-interval=0.2",
                str(SCRIPT), str(self.root), str(self.out), str(self.steps), *self.extra,
            ]
            inner = f"mount --bind {self.node_dir(node)} {self.root / 'local'} && exec \"$@\""
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", inner, "sh", *torchrun]
            log = self.out / f"node{node}.log"
            self.logs.append(log)
            with open(log, "ab") as f:
                self.procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env))
            if node == 0:
                time.sleep(0.5)  # node 0's agent hosts the rendezvous store

    def wait(self, timeout: float) -> None:
        """Both agents exit 0 within ``timeout`` seconds, or the job is killed and the logs raised."""
        deadline = time.monotonic() + timeout
        try:
            for p in self.procs:
                p.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job did not finish in {timeout:g}s:\n{self.text()}") from None
        codes = [p.returncode for p in self.procs]
        if any(codes):
            raise AssertionError(f"the job failed ({codes}):\n{self.text()}")

    def wait_for(self, path: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"{path} never appeared:\n{self.text()}")
            time.sleep(0.05)

    def kill(self, node: int | None = None) -> None:
        """SIGKILL a node's agent and every process below it: the whole node dies at once."""
        import psutil

        for i, p in enumerate(self.procs):
            if node is None or i == node:
                try:
                    tree = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
                except psutil.NoSuchProcess:
                    tree = []
                for proc in tree:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        proc.send_signal(signal.SIGKILL)
                p.wait(timeout=30)
                psutil.wait_procs(tree, timeout=30)

    def text(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-6000:]}" for log in self.logs if log.exists())
