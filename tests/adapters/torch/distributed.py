"""Running a test function on several gloo ranks in real processes.

Each rank runs ``fn(rank, world_size, workdir)`` and may write JSON results to ``workdir``. Ranks
end with the process group destroyed and ``os._exit`` after flushing, the recipe that avoids
gloo's teardown aborts; a rank that raised writes its traceback and exits non-zero.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, workdir: str, env: dict) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, workdir)
        dist.barrier()
    except BaseException:
        code = 1
        with open(os.path.join(workdir, f"error{rank}.txt"), "w") as handle:
            handle.write(traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_ranks(fn: Callable, world_size: int, workdir: str, env: dict | None = None) -> list[dict]:
    """Run ``fn`` on ``world_size`` ranks; return each rank's ``result{rank}.json`` (raise on failure)."""
    context = mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), workdir, env or {}),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    try:
        while not context.join(timeout=300):
            pass
    except Exception as exc:
        errors = []
        for name in sorted(os.listdir(workdir)):
            if name.startswith("error"):
                with open(os.path.join(workdir, name)) as handle:
                    errors.append(handle.read())
        raise AssertionError("a rank failed:\n" + "\n".join(errors)) from exc
    results = []
    for rank in range(world_size):
        path = os.path.join(workdir, f"result{rank}.json")
        with open(path) as handle:
            results.append(json.load(handle))
    return results


def save_result(workdir: str, rank: int, result: dict) -> None:
    with open(os.path.join(workdir, f"result{rank}.json"), "w") as handle:
        json.dump(result, handle)
