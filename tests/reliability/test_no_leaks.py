"""Promise 5: no leaks.

The long form is ``benchmarks/leak.py`` (2,000 monitored steps, RSS at step 200 against the end).
Here a shorter form that still catches a per-step leak: after a warm-up, two windows of 50 steps
with every data type on. No type of live Python object (tensors included) may grow in both windows
(a one-time cache fill grows in one), the resident set size may not grow by 1% over the second
window (one step's activations are ~1% of RSS, so keeping each step's autograd graph would grow it
by half; the first window holds one-time growth, which is a larger share of a smaller process such
as the PyTorch-only install's), and the open descriptors not at all. After stop(), no hook, wrapper
or thread of ours remains and nothing global keeps the monitor alive.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import threading
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from adapters.torch.cc_wrap import COLLECTIVES
from monitor import TrainerMon
from tests.reliability.training import EVERYTHING, Net, hook_state, make_batches, train

C10D = dist.distributed_c10d


def _leak_benchmark():
    """benchmarks/leak.py as a module (benchmarks/ is not a package)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "leak.py"
    spec = importlib.util.spec_from_file_location("trainmon_leak_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_long_run_does_not_grow_objects_rss_or_descriptors():
    leak = _leak_benchmark()
    config = {**leak.CONFIG, "step_count_per_record": 10}  # files roll over during the measurement
    run = leak.Run(config, width=128, batch=64)
    run.steps(40)
    fds = leak.open_descriptors()
    counts, rss = [leak.live_objects()], [leak.rss_bytes()]
    for _ in range(2):
        run.steps(50)
        counts.append(leak.live_objects())
        rss.append(leak.rss_bytes())
    rss_growth = (rss[2] - rss[1]) / rss[1]
    fds_after = leak.open_descriptors()
    run.mon.stop()
    # a per-step leak grows in both 60-step windows; a one-time cache fill (ABC caches, ...) in one
    first, second = counts[1] - counts[0], counts[2] - counts[1]
    grown = {k: (first[k], second[k]) for k in first | second if min(first[k], second[k]) > 2}
    assert not grown, f"object types that grew in both 50-step windows: {grown}"
    assert rss_growth < 0.01, f"RSS grew by {100 * rss_growth:.2f}% over the second 50 steps ({rss})"
    assert fds_after == fds, f"open descriptors {fds} -> {fds_after}"


def _collective_identities() -> dict[str, tuple[int, int]]:
    return {name: (id(getattr(dist, name, None)), id(getattr(C10D, name, None))) for name in COLLECTIVES}


def _trainmon_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("trainmon")]


FULL = {
    **EVERYTHING,
    "format": "tensorboard",
    "stack_info": True,
    "cc_distribution": {"enable": True, "cc_pre_hook": True},
    "alert": {"rules": [{"rule_name": "AnomalyZScore", "args": {"threshold": 3}}], "dump": True},
}


@pytest.mark.parametrize("ended_by", ["stop", "collect_times"])
def test_after_stop_no_hook_wrapper_thread_or_reference_remains(ended_by):
    assert not _trainmon_threads(), "a trainmon thread of an earlier test is still running"
    torch.manual_seed(0)
    model = Net(reentrant=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    hooks, identities = hook_state(model, optimizer), _collective_identities()
    config = {**FULL, "collect_times": 2} if ended_by == "collect_times" else FULL
    mon = TrainerMon(config)
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    assert hook_state(model, optimizer) != hooks and _collective_identities() != identities
    assert _trainmon_threads()
    train(model, optimizer, make_batches(4, 2))
    mon.stop()
    assert hook_state(model, optimizer) == hooks
    assert _collective_identities() == identities, "torch.distributed functions are not the originals"
    assert not _trainmon_threads()
    reference = weakref.ref(mon)
    del mon
    gc.collect()
    assert reference() is None, (
        f"still referred to by {[type(r).__name__ for r in gc.get_referrers(reference())]}"
    )
    train(model, optimizer, make_batches(2, 2))  # the model trains on, untouched


def test_repeated_attach_and_stop_leaves_nothing_behind():
    """Ten monitors in a row on the same model: descriptors, threads and hooks come back each time."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    hooks, fds = hook_state(model, optimizer), len(os.listdir("/proc/self/fd"))
    for _ in range(10):
        mon = TrainerMon(FULL)
        mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
        train(model, optimizer, make_batches(2, 1))
        mon.stop()
    assert hook_state(model, optimizer) == hooks
    assert len(os.listdir("/proc/self/fd")) == fds
    assert not _trainmon_threads()
