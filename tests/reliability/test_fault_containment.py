"""Promise 2: faults are contained.

A failure inside the monitor (a statistic, a hook, the writer thread, the anomaly dump, an output
directory that becomes read-only, a collective wrapper) never reaches the training loop: training
completes bit-identical to a run without the monitor, the failure is logged once with its cause,
the failed part is switched off while the rest keeps working, and stop() still removes everything.

How the faults are made:
* statistics and hooks: the function inside the monitor raises (monkeypatched from a given step);
* disk full: every descriptor the monitor holds in its output directory is replaced (dup2) by one
  on /dev/full, so the kernel itself answers ENOSPC to the next write;
* anomaly dump: its directory is replaced by a regular file, so the atomic replacement of
  anomaly.json fails with ENOTDIR;
* read-only directory: the tests run as root, for whom chmod does not stop writes; the directory
  is bind-mounted read-only over itself (real EROFS) where mounting is allowed, and otherwise
  os.open is made to answer EACCES for paths inside it (the one simulated fault; the test says
  which way it ran).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
import threading
import types
from collections.abc import Callable

import pytest
import torch

import adapters.torch.activations as activations_module
import adapters.torch.grads as grads_module
import adapters.torch.stats as stats_module
import adapters.torch.structure as structure_module
import monitor.structure as monitor_structure
from adapters.torch import in_place, row_buffer
from monitor import TrainerMon
from tests.extras import OUTPUT_FORMATS
from tests.reliability.ranks import FAULT_STEP as CC_FAULT_STEP
from tests.reliability.training import ALL_OPS, EVERYTHING, Net, csv_steps, hook_state, make_batches, train
from tests.shared_configs import STEP_PREFIXES

STEPS = 8
GRAD_ACC = 2
#: faults are switched on after step FAULT_STEP - 1 is written: step FAULT_STEP is the first to fail.
FAULT_STEP = 3
#: gradient spikes (losses scaled up) after the fault; the anomaly rule must report the last one.
SPIKE_STEPS = (5, 7)
SPIKE_RULES = {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 1000.0}}], "dump": True}

PREFIXES = (*STEP_PREFIXES, "actv", "actv_grad")


def _train(model, optimizer, after_step=None) -> list[float]:
    batches = make_batches(STEPS, GRAD_ACC, seed=11)
    return train(model, optimizer, batches, after_step, loss_scale=dict.fromkeys(SPIKE_STEPS, 1e6))


def _plain() -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    losses = _train(model, optimizer)
    return losses, [p.detach().clone() for p in model.parameters()]


class Outcome:
    """What a faulted run left: its monitor (stopped), output directory and last collected steps."""

    def __init__(self, mon: TrainerMon, latest_steps: dict[str, int]) -> None:
        self.mon = mon
        self.output_dir = mon.output_dir
        self.latest_steps = latest_steps

    def steps(self, prefix: str) -> set[int]:
        return set(csv_steps(self.output_dir, prefix))


def _faulted_run(config: dict, inject: Callable[[TrainerMon], None]) -> Outcome:
    """Train STEPS steps with ``inject(mon)`` called after step FAULT_STEP - 1 has been written.

    Asserts the promises every fault shares: the loop never sees an exception, losses and
    parameters are bit-identical to a run without the monitor, anomalies after the fault are still
    detected, stop() removes every hook and ends the writer thread.
    """
    plain_losses, plain_params = _plain()
    threads_before = {t.ident for t in threading.enumerate()}
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # moments exist; a spike stays a spike
    hooks_before = hook_state(model, optimizer)
    mon = TrainerMon({"ops": ALL_OPS, **config})
    mon.set_monitor(model, grad_acc_steps=GRAD_ACC, optimizer=optimizer)

    def after_step(step: int) -> None:
        if step == FAULT_STEP - 1:
            mon.flush()
            inject(mon)

    losses = _train(model, optimizer, after_step)
    mon.flush()
    latest = mon._core.latest
    latest_steps = {prefix: record.step for prefix, record in latest._latest.items()}
    mon.stop()
    assert losses == plain_losses
    for a, b in zip(plain_params, model.parameters(), strict=True):
        assert torch.equal(a, b.detach())
    assert hook_state(model, optimizer) == hooks_before
    left = [t.name for t in threading.enumerate() if t.ident not in threads_before]
    assert not [name for name in left if name.startswith("trainmon")], left
    return Outcome(mon, latest_steps)


def _the_one_error(log, *words: str):
    """Exactly one ERROR record, and it names every word (in its message or its exception)."""
    errors = log.errors()
    assert len(errors) == 1, [r.getMessage() for r in errors]
    record = errors[0]
    text = record.getMessage() + " " + repr(record.exc_info[1] if record.exc_info else "")
    for word in words:
        assert word in text, f"{word!r} not in {text!r}"
    return record


def _assert_switched_off(outcome: Outcome, off: tuple[str, ...]) -> None:
    """``off`` has every step before the fault and none after it; everything else has every step."""
    everything = set(range(STEPS))
    for prefix in PREFIXES:
        steps = outcome.steps(prefix)
        if prefix in off:
            assert set(range(FAULT_STEP)) <= steps, f"{prefix}: {sorted(steps)}"
            assert not steps & set(range(FAULT_STEP + 1, STEPS)), f"{prefix} still on: {sorted(steps)}"
        elif steps or prefix not in ("actv", "actv_grad"):
            assert steps == everything, f"{prefix} should keep working: {sorted(steps)}"


def _spike_reported(outcome: Outcome) -> bool:
    return any(a.step == SPIKE_STEPS[-1] for a in outcome.mon.anomalies)


ALL_CONFIG = {**EVERYTHING, "alert": SPIKE_RULES}


# -- statistics and hooks ---------------------------------------------------------------------


def test_a_statistic_that_raises_switches_off_its_data_type_only(monkeypatch, trainmon_log):
    failing = {"on": False, "pointers": set()}
    original = stats_module._group_columns

    def group_columns(tensors, ops, eps):
        if failing["on"] and {t.data_ptr() for t in tensors} & failing["pointers"]:
            raise RuntimeError("injected: statistic failed")
        return original(tensors, ops, eps)

    original_kernel = in_place.kernel_parts

    def kernel_parts(kind, addresses, counts, eps):  # where the kernel reads CPU tensors in place
        if failing["on"] and set(addresses) & failing["pointers"]:
            raise RuntimeError("injected: statistic failed")
        return original_kernel(kind, addresses, counts, eps)

    monkeypatch.setattr(stats_module, "_group_columns", group_columns)
    for reader in (stats_module, row_buffer):  # both read CPU tensors through the kernel
        monkeypatch.setattr(reader, "kernel_parts", kernel_parts)

    def inject(mon):
        optimizer = mon._session.optimizer
        failing["pointers"] = {s["exp_avg_sq"].data_ptr() for s in optimizer.state.values()}
        failing["on"] = True

    outcome = _faulted_run(ALL_CONFIG, inject)
    _the_one_error(trainmon_log, "exp_avg_sq", "injected: statistic failed")
    _assert_switched_off(outcome, ("exp_avg_sq",))


def _raising(function: Callable, when: Callable[..., bool] = lambda *a, **k: True) -> Callable:
    def wrapper(*args, **kwargs):
        if when(*args, **kwargs):
            raise RuntimeError("injected: hook failed")
        return function(*args, **kwargs)

    return wrapper


def _break_module_forward_hooks(monkeypatch, mon):
    monkeypatch.setattr(
        activations_module, "direction_tensors_of", _raising(activations_module.direction_tensors_of)
    )


def _break_activation_gradient_hooks(monkeypatch, mon):
    cls = activations_module.Activations
    monkeypatch.setattr(
        cls, "_measure", _raising(cls._measure, lambda self, prefix, *a: prefix == "actv_grad")
    )


def _break_parameter_gradient_hooks(monkeypatch, mon):
    buffer = grads_module.RowBuffer
    monkeypatch.setattr(buffer, "put", _raising(buffer.put))  # a gradient measured in its hook
    monkeypatch.setattr(buffer, "put_many", _raising(buffer.put_many))  # or at the backward's end


def _break_optimizer_step_hooks(monkeypatch, mon):
    backend = type(mon._session.backend)  # reading a moment raises: exp_avg, exp_avg_sq, mg_direction
    monkeypatch.setattr(backend, "moment", _raising(backend.moment))


#: how to break a kind of hook, and the parts whose failure is logged and switched off.
HOOKS = {
    "module_forward_hook": (_break_module_forward_hooks, ["actv"], ("actv", "actv_grad")),
    "activation_gradient_hook": (_break_activation_gradient_hooks, ["actv_grad"], ("actv", "actv_grad")),
    "parameter_gradient_hook": (_break_parameter_gradient_hooks, ["grad_unreduced"], ("grad_unreduced",)),
    "optimizer_step_hook": (
        _break_optimizer_step_hooks,
        ["exp_avg", "exp_avg_sq", "other"],
        ("exp_avg", "exp_avg_sq", "other"),
    ),
}


@pytest.mark.parametrize("hook", list(HOOKS))
def test_a_hook_that_raises_is_contained(hook, monkeypatch, trainmon_log):
    breaker, parts, off = HOOKS[hook]
    outcome = _faulted_run(ALL_CONFIG, lambda mon: breaker(monkeypatch, mon))
    errors = trainmon_log.errors()
    failed = sorted(r.getMessage().split(" failed")[0].removeprefix("trainmon: ") for r in errors)
    assert failed == parts, [r.getMessage() for r in errors]  # each part logged once
    for record in errors:
        assert "injected: hook failed" in record.getMessage()
    _assert_switched_off(outcome, off)
    assert _spike_reported(outcome)


def test_an_unexpected_error_at_the_start_of_the_optimizer_step_is_contained(monkeypatch, trainmon_log):
    """Not one part failing (those are guarded one by one) but the pre-step hook itself."""

    def inject(mon):
        collection = type(mon._session.collection)
        monkeypatch.setattr(collection, "before_update", _raising(collection.before_update))

    _faulted_run(ALL_CONFIG, inject)  # same losses and parameters as an unmonitored run
    _the_one_error(trainmon_log, "step start", "injected: hook failed")


# -- the writer thread and the file system ----------------------------------------------------


def _descriptors_under(directory: str) -> list[int]:
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(directory + os.sep):
            found.append(int(name))
    return found


def _fill_the_disk(mon: TrainerMon) -> None:
    """Every descriptor open in the rank directory now writes to /dev/full (ENOSPC from the kernel)."""
    descriptors = _descriptors_under(mon.output_dir)
    assert descriptors, "the writer holds no file open in its output directory"
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        for fd in descriptors:
            os.dup2(full, fd)
    finally:
        os.close(full)


def _fill_the_disk_for_new_files(monkeypatch) -> Callable[[TrainerMon], None]:
    """From now on every file the Parquet writer creates writes to /dev/full (ENOSPC from the
    kernel): it closes its files after each step, so there is no open descriptor to redirect."""
    import monitor.writers.parquet as parquet_writer

    def fill(mon: TrainerMon) -> None:
        mkstemp = tempfile.mkstemp

        def full_mkstemp(*args, **kwargs):
            fd, path = mkstemp(*args, **kwargs)
            full = os.open("/dev/full", os.O_WRONLY)
            os.dup2(full, fd)
            os.close(full)
            return fd, path

        # only the Parquet writer's files: the anomaly files stay writable, as with the other formats
        monkeypatch.setattr(parquet_writer, "tempfile", types.SimpleNamespace(mkstemp=full_mkstemp))

    return fill


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_a_full_disk_switches_off_the_file_writer_and_nothing_else(fmt, trainmon_log, monkeypatch):
    config = {**ALL_CONFIG, "format": fmt, "step_count_per_record": 100}
    outcome = _faulted_run(
        config, _fill_the_disk_for_new_files(monkeypatch) if fmt == "parquet" else _fill_the_disk
    )
    writer = {"csv": "CsvWriter", "tensorboard": "TensorBoardWriter", "parquet": "ParquetWriter"}[fmt]
    _the_one_error(trainmon_log, writer, "No space left on device")
    # the rest keeps working: the in-memory values reach the last step, anomalies are still found
    assert set(outcome.latest_steps.values()) == {STEPS - 1}
    assert _spike_reported(outcome)
    if fmt == "csv":  # what was written before the disk filled up is intact
        for prefix in ("grad_reduced", "param_updated", "actv"):
            assert set(outcome.steps(prefix)) == set(range(FAULT_STEP)), prefix
    if fmt == "parquet":
        import pyarrow.parquet as pq

        from monitor.writers.parquet_files import live_prefixes

        found = live_prefixes(outcome.output_dir)
        for prefix in ("grad_reduced", "param_updated", "actv"):
            assert set(pq.read_table(found[prefix]).column("step").to_pylist()) == set(range(FAULT_STEP))


def _replace_dump_directory_by_a_file(mon: TrainerMon) -> None:
    directory = os.path.join(os.path.dirname(mon.output_dir), "anomaly_detected", "rank0")
    shutil.rmtree(directory)
    with open(directory, "w") as handle:
        handle.write("not a directory")


def test_a_failing_anomaly_dump_leaves_the_other_outputs_working(trainmon_log):
    outcome = _faulted_run(ALL_CONFIG, _replace_dump_directory_by_a_file)
    _the_one_error(trainmon_log, "Not a directory")
    _assert_switched_off(outcome, ())


def test_a_failing_anomaly_dump_does_not_stop_anomaly_detection(trainmon_log):
    outcome = _faulted_run(ALL_CONFIG, _replace_dump_directory_by_a_file)
    assert _spike_reported(outcome)


@pytest.fixture
def read_only(monkeypatch):
    """``make(directory)`` makes a directory read-only for this process; returns how it did it."""
    mounted: list[str] = []

    def make(directory: str) -> str:
        if os.geteuid() != 0:
            os.chmod(directory, 0o550)
            return "chmod"
        bind = subprocess.run(["mount", "--bind", directory, directory], capture_output=True)
        if bind.returncode == 0:
            mounted.append(directory)
            ro = subprocess.run(["mount", "-o", "remount,bind,ro", directory, directory], capture_output=True)
            if ro.returncode == 0:
                return "read-only bind mount"
        prefix = directory + os.sep
        real_open = os.open

        def refusing_open(path, flags, *args, **kwargs):
            if os.fspath(path).startswith(prefix) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refusing_open)
        return "os.open refusing writes (simulated: mounting is not allowed here)"

    yield make
    for directory in reversed(mounted):
        subprocess.run(["umount", "-l", directory], capture_output=True)


def test_an_output_directory_made_read_only_mid_run_is_contained(read_only, trainmon_log):
    how = {}

    def inject(mon):
        how["way"] = read_only(mon.output_dir)

    config = {**ALL_CONFIG, "step_count_per_record": 1}  # a new file per step: creation must fail
    outcome = _faulted_run(config, inject)
    record = _the_one_error(trainmon_log, "CsvWriter")
    assert any(w in record.getMessage() for w in ("Read-only", "Permission denied")), (
        how,
        record.getMessage(),
    )
    assert set(outcome.latest_steps.values()) == {STEPS - 1}
    assert _spike_reported(outcome)
    for prefix in ("grad_reduced", "exp_avg", "actv_grad"):
        assert set(outcome.steps(prefix)) == set(range(FAULT_STEP)), (prefix, how)


def test_a_failing_print_struct_write_is_contained(trainmon_log):
    def block_module_struct(mon):
        with open(os.path.join(os.path.dirname(mon.output_dir), "module_struct"), "w") as handle:
            handle.write("not a directory")

    config = {**ALL_CONFIG, "print_struct": True}
    plain_losses, _ = _plain()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    mon = TrainerMon({"ops": ALL_OPS, **config})
    mon.set_monitor(model, grad_acc_steps=GRAD_ACC, optimizer=optimizer)
    block_module_struct(mon)
    try:
        losses = _train(model, optimizer)
    finally:
        mon.stop()
    assert losses == plain_losses
    _the_one_error(trainmon_log, "print_struct", "Not a directory")


@pytest.mark.parametrize(
    ("module", "function", "part", "config"),
    [
        (structure_module, "describe", "print_struct", {"print_struct": True}),  # the forward hook
        (monitor_structure, "stack_frames", "stack_info", {"stack_info": True}),  # the pre-hook
    ],
)
def test_a_failing_structure_hook_is_contained(module, function, part, config, monkeypatch, trainmon_log):
    """print_struct and stack_info record from hooks inside the forward pass: one that raises is
    logged once and switched off, and training runs as without the monitor."""
    plain_losses, _ = _plain()
    monkeypatch.setattr(module, function, _raising(getattr(module, function)))
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    mon = TrainerMon({"ops": ALL_OPS, **ALL_CONFIG, **config})
    mon.set_monitor(model, grad_acc_steps=GRAD_ACC, optimizer=optimizer)
    try:
        losses = _train(model, optimizer)
    finally:
        mon.stop()
    assert losses == plain_losses
    _the_one_error(trainmon_log, part, "injected: hook failed")


def test_a_failing_print_struct_gradient_hook_is_contained(monkeypatch, trainmon_log):
    """A gradient hook of print_struct that raises inside the backward pass: logged once, the
    backward completes, no incomplete structure is written, and the run goes on (print_struct
    stops a run only once it has written the whole structure)."""
    monkeypatch.setattr(structure_module, "record_grad", _raising(structure_module.record_grad))
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    mon = TrainerMon({"ops": ALL_OPS, "print_struct": True})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    x = make_batches(1, 1)[0][0]
    model(x).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    optimizer.step()  # no StructurePrinted
    model(x).square().mean().backward()
    optimizer.step()
    mon.stop()
    _the_one_error(trainmon_log, "print_struct", "injected: hook failed")
    assert not os.path.exists(os.path.join(os.path.dirname(mon.output_dir), "module_struct"))


# -- collectives (two gloo ranks) -------------------------------------------------------------


@pytest.mark.distributed
def test_a_failing_collective_monitor_is_contained(two_rank_results):
    for rank, result in enumerate(two_rank_results):
        plain, faulted = result["plain"], result["faulted"]
        assert faulted["losses"] == plain["losses"], f"rank {rank}: the fault changed the training"
        assert faulted["params"] == plain["params"], f"rank {rank}"
        assert len(faulted["errors"]) == 1, faulted["errors"]
        assert "comm" in faulted["errors"][0] and "injected" in faulted["errors"][0]
        assert faulted["comm_steps"] == list(range(CC_FAULT_STEP)), faulted["comm_steps"]
        assert faulted["grad_steps"] == list(range(20)), "the rest of the monitor should keep working"
        assert faulted["hooks_restored"], f"rank {rank}: stop() left hooks behind"
