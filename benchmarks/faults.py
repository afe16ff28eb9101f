"""Training with injected faults, for measuring the monitor's anomaly detection (benchmarks/incidents.py).

``run_case(case, config, output_root)`` trains one small model (benchmarks/fault_models.py: ``gpt``,
the demo's TinyGPT shrunk to ~34k parameters, or ``mlp``, a ~11k-parameter residual MLP) with
TrainerMon attached on every rank, in this process or in ``case.ranks`` spawned gloo processes
under DistributedDataParallel, and injects at most one fault at ``case.fault_step``. Data are
synthetic and a function of (seed, rank, step, micro-batch); the learning rate warms up linearly
over the first 10% of the steps and then decays on a cosine, so statistics drift as in real runs.
``expected(case)`` says where a perfect detector would put the root.

Faults (at the fault step only unless said; targets per family in fault_models.TARGETS;
"one rank" faults hit ``fault_rank`` under DDP and rank 0 alone):
  loss_x100, loss_x1000  every micro-batch's loss x100 / x1000, every rank (no single module)
  nan_activation         one rank, first micro-batch: one output element of a Linear set to NaN
                         (gpt layers.1.mlp.0, mlp blocks.1.fc)
  inf_overflow           one rank: a Linear computes in float16 with its result x1e6 (as if its input were
                         1e6 times larger): outputs overflow to +-Inf (gpt layers.1.qkv, mlp blocks.0.fc)
  grad_after_backward    every rank, after backward (and the all-reduce): the largest element of one
                         .grad x1e4 (gpt layers.0.mlp.2.weight, mlp blocks.1.fc.weight)
  grad_before_reduce     one rank, last micro-batch, in a tensor hook before the reduction: the largest
                         element of one gradient x1e4 (gpt layers.1.mlp.2.weight, mlp blocks.0.fc.weight)
  weight_flip            one rank, before the forward: one weight element set to 1e4
                         (gpt layers.0.mlp.0.weight, mlp blocks.0.fc.weight)
  lr_x100                every param group's lr x100 from the fault step on, every rank (no single module)
  bad_batch              one rank: its micro-batches replaced by garbage (gpt: one token repeated;
                         mlp: inputs x1000); the root is the data, so no module is expected
  dead_layer             every rank, from the fault step on: one weight's gradient is zeroed by a tensor
                         hook (gpt layers.0.proj.weight, mlp blocks.1.fc.weight)

    python benchmarks/faults.py --family gpt --fault nan_activation --steps 100
    python benchmarks/faults.py --family mlp --ranks 4 --fault bad_batch
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from blocks import free_port  # noqa: E402
from fault_models import BASE_LR, FAULTS, NO_MODULE, ONE_RANK_FAULTS, TARGETS, Injector, build_task  # noqa: E402

RANK_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Case:
    """One training run: model family, optimizer, clipping, accumulation, seed, and at most one fault."""

    family: str  # "gpt" or "mlp"
    optimizer: str  # "adamw" or "sgd" (momentum 0.9)
    clip: bool  # clip_grad_norm_(1.0) before optimizer.step()
    grad_acc: int  # micro-batches per step
    seed: int
    fault: str | None  # None: a clean run; else one of FAULTS
    fault_step: int  # the step the fault happens at (ignored when clean)
    steps: int  # optimizer steps
    ranks: int = 1  # 1: this process; more: that many gloo processes under DDP
    fault_rank: int = 1  # the rank of a one-rank fault under DDP


@dataclass(frozen=True)
class Expected:
    """Where a perfect detector puts the root of a fault."""

    step: int  # the step the fault must be detected at
    modules: tuple[str, ...]  # substrings, one of which the root's tag must contain; () for no single module
    rank: int | None  # the root's rank for one-rank faults under DDP; else None


def check(case: Case) -> None:
    """Raise ValueError for a case that names an unknown part or whose fault would never happen."""
    if case.family not in TARGETS or case.optimizer not in ("adamw", "sgd"):
        raise ValueError(f"unknown family or optimizer in {case}: expected gpt|mlp and adamw|sgd")
    if case.grad_acc < 1 or case.ranks < 1 or case.steps < 1:
        raise ValueError(f"grad_acc, ranks and steps must be >= 1: {case}")
    if case.fault is not None:
        if case.fault not in FAULTS:
            raise ValueError(f"unknown fault {case.fault!r}: expected one of {', '.join(FAULTS)}")
        if not 0 <= case.fault_step < case.steps or (
            case.ranks > 1 and not 0 <= case.fault_rank < case.ranks
        ):
            raise ValueError(f"the fault step or rank is outside the run: {case}")


def expected(case: Case) -> Expected | None:
    """The expected root of ``case``'s fault; None for a clean run.

    An activation fault's module covers its output and the gradients it causes there; a flipped
    weight's own row or its module's output (the first place the flip shows in a step) is right.
    """
    check(case)
    if case.fault is None:
        return None
    target = TARGETS[case.family].get(case.fault)
    if case.fault in NO_MODULE:
        modules: tuple[str, ...] = ()
    elif case.fault == "weight_flip":
        modules = (target, target.rsplit(".", 1)[0] + ".output")
    else:
        modules = (target,)
    rank = case.fault_rank if case.ranks > 1 and case.fault in ONE_RANK_FAULTS else None
    return Expected(case.fault_step, modules, rank)


def learning_rate(case: Case, step: int) -> float:
    """Linear warm-up over the first 10% of the steps, then cosine decay to 10% of the base lr."""
    base = BASE_LR[(case.family, case.optimizer)]
    warm = max(1, case.steps // 10)
    if step < warm:
        return base * (step + 1) / warm
    progress = (step - warm) / max(1, case.steps - warm)
    return base * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


class _LogCounter(logging.Handler):
    """Counts the monitor's incident announcements, other warnings and errors; keeps the first few others."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts = {"incidents": 0, "warnings": 0, "errors": 0}
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.levelno >= logging.ERROR:
            self.counts["errors"] += 1
        elif text.startswith("trainmon: incident "):
            self.counts["incidents"] += 1
            return
        else:
            self.counts["warnings"] += 1
        if len(self.messages) < 5 and text[:200] not in self.messages:
            self.messages.append(text[:200])


def _train(case: Case, config: dict, rank: int, quiet: bool) -> dict:
    """The training loop of one rank; returns this rank's losses, time and monitor log counts."""
    from monitor import TrainerMon

    torch.set_num_threads(1)
    logger = logging.getLogger("trainmon")
    counter = _LogCounter()
    saved = (list(logger.handlers), logger.propagate)
    if quiet:
        logger.handlers, logger.propagate = [], False
    logger.addHandler(counter)
    try:
        task = build_task(case.family, case.seed)
        model = task.model
        wrapped = nn.parallel.DistributedDataParallel(model) if case.ranks > 1 else model
        lr = learning_rate(case, 0)
        if case.optimizer == "adamw":
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        mon = TrainerMon(config)
        mon.set_monitor(wrapped, grad_acc_steps=case.grad_acc, optimizer=optimizer)
        injector = Injector(case, task, rank)
        losses = []
        started = time.perf_counter()
        for step in range(case.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(case, step) * injector.lr_factor(step)
            injector.begin_step(step)
            total = 0.0
            for micro in range(case.grad_acc):
                inputs, targets = injector.batch(step, task.batch(rank, step, micro))
                syncs = case.ranks == 1 or micro == case.grad_acc - 1
                with contextlib.nullcontext() if syncs else wrapped.no_sync():
                    loss = task.loss(wrapped(inputs), targets) * (injector.loss_factor(step) / case.grad_acc)
                    loss.backward()
                total += loss.item()
            injector.end_backward(step)
            if case.clip:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            injector.end_step(step)
            losses.append(total)
        mon.stop()
        seconds = time.perf_counter() - started
    finally:
        logger.removeHandler(counter)
        logger.handlers[:], logger.propagate = saved
    return {"losses": losses, "seconds": seconds, "log": {**counter.counts, "messages": counter.messages}}


def _rank_entry(rank: int, case: Case, config: dict, env: dict, port: int, workdir: str, quiet: bool) -> None:
    """One DDP rank: train, write the result to ``workdir``, end by os._exit (gloo's teardown aborts else)."""
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(case.ranks)
    )
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=case.ranks)
        result = _train(case, config, rank, quiet)
        with open(os.path.join(workdir, f"result{rank}.json"), "w") as handle:
            json.dump(result, handle)
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


def _run_ranks(case: Case, config: dict, env: dict, quiet: bool) -> list[dict]:
    """Spawn ``case.ranks`` gloo processes; every rank's result (raise with the tracebacks on failure)."""
    with tempfile.TemporaryDirectory(prefix="trainmon-faults-") as workdir:
        context = mp.start_processes(
            _rank_entry,
            args=(case, config, env, free_port(), workdir, quiet),
            nprocs=case.ranks,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + RANK_TIMEOUT_S
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    raise TimeoutError(f"{case} did not finish in {RANK_TIMEOUT_S:.0f} s")
        except Exception as exc:
            errors = [path.read_text() for path in sorted(Path(workdir).glob("error*"))]
            raise RuntimeError(f"a rank of {case} failed:\n" + "\n".join(errors)) from exc
        results = []
        for rank in range(case.ranks):
            with open(os.path.join(workdir, f"result{rank}.json")) as handle:
                results.append(json.load(handle))
        return results


def run_case(case: Case, config: dict, output_root: str, quiet: bool = False) -> dict:
    """Train ``case`` with TrainerMon(config) on every rank, writing under ``output_root``.

    Returns ``losses`` (rank 0's, per step), ``seconds`` (rank 0's training loop, monitor drain
    included), ``wall_seconds`` (the whole call, process start-up included), ``steps``,
    ``expected`` (``Expected`` as a dict, None when clean), ``anomaly_dir`` and ``log`` (the
    monitor's warning and error counts per rank). ``quiet`` keeps the monitor's log off stderr.
    """
    started = time.perf_counter()
    root = expected(case)  # checks the case too
    output_root = os.path.abspath(output_root)
    env = {"MONITOR_OUTPUT_DIR": output_root}
    if case.ranks > 1:
        results = _run_ranks(case, config, env, quiet)
    else:
        saved = os.environ.get("MONITOR_OUTPUT_DIR")
        os.environ.update(env)
        try:
            results = [_train(case, config, 0, quiet)]
        finally:
            if saved is None:
                del os.environ["MONITOR_OUTPUT_DIR"]
            else:
                os.environ["MONITOR_OUTPUT_DIR"] = saved
    return {
        "losses": results[0]["losses"],
        "seconds": results[0]["seconds"],
        "wall_seconds": time.perf_counter() - started,
        "steps": case.steps,
        "expected": dataclasses.asdict(root) if root else None,
        "anomaly_dir": os.path.join(output_root, "anomaly_detected"),
        "log": [result["log"] for result in results],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__[__doc__.index("Faults (") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--family", choices=("gpt", "mlp"), default="gpt")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--clip", action="store_true")
    parser.add_argument("--grad-acc", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault", choices=FAULTS)
    parser.add_argument("--fault-step", type=int, default=60)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--config", help="monitor config (JSON); default: every data type, AnomalyNan, dump")
    parser.add_argument("--output", help="output root (default: a temporary directory)")
    args = parser.parse_args(argv)
    case = Case(
        args.family, args.optimizer, args.clip, args.grad_acc, args.seed,
        args.fault, args.fault_step, args.steps, args.ranks,
    )  # fmt: skip
    if args.config:
        with open(args.config) as handle:
            config = json.load(handle)
    else:
        config = {key: True for key in ("wg_distribution", "mv_distribution", "param_distribution")}
        config.update(xy_distribution=True, all_xy=True)
        config["alert"] = {"rules": [{"rule_name": "AnomalyNan"}], "dump": True}
    output = args.output or tempfile.mkdtemp(prefix="trainmon-faults-")
    summary = run_case(case, config, output, quiet=True)
    losses = summary["losses"]
    around = range(max(0, case.fault_step - 2), min(case.steps, case.fault_step + 3)) if case.fault else []
    print(case)
    print(f"{summary['seconds']:.2f} s training, {summary['wall_seconds']:.2f} s in all; output {output}")
    near = ", ".join(f"{step}: {losses[step]:.4g}" for step in around)
    print(f"loss: first {losses[0]:.4g}, last {losses[-1]:.4g}; around the fault step: {near}")
    print(f"expected root: {summary['expected']}; monitor log: {summary['log']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
