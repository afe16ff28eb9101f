"""Run a worker script on several MindSpore ranks with msrun (CPU, one process per rank)."""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
#: seconds a rank waits for the other before the job fails (small, so a broken run ends fast).
CLUSTER_TIME_OUT = 60


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        return f"--- {path}\n{handle.read()[-3000:]}"


def run_msrun(worker: str, workdir: Path, ranks: int) -> None:
    """Run ``worker workdir`` on ``ranks`` ranks; fails with the workers' logs when the job fails."""
    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "MONITOR_OUTPUT_DIR": str(workdir / "monitor_output"),
    }
    command = [
        sys.executable,
        "-c",
        "import sys; from mindspore.parallel.cluster.run import main; sys.exit(main())",
        f"--worker_num={ranks}",
        f"--local_worker_num={ranks}",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        f"--log_dir={workdir / 'logs'}",
        "--join=True",
        f"--cluster_time_out={CLUSTER_TIME_OUT}",
        worker,
        str(workdir),
    ]
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=240)
    logs = "".join(_tail(path) for path in sorted(glob.glob(str(workdir / "logs" / "worker_*.log"))))
    assert done.returncode == 0, f"msrun exit {done.returncode}\n{done.stdout[-2000:]}\n{logs}"
