"""The training process that test_crash_safety kills with SIGKILL (run in a forked child).

``run(out_dir, fmt, kill_step, where)`` trains Net with every data type, anomaly rules and the
anomaly dump on, and kills its own process with SIGKILL:

* ``training``: on the training thread in step ``kill_step``, after its backward passes (the
  optimizer step of that step never runs). A short pause before the kill stands for the rest of a
  real training step's compute, which is when a real job is most likely to die;
* ``writer``: on the writer thread, in the middle of writing step ``kill_step`` (after its third
  record has gone to the file writer), so a write is cut short;
* ``slow_disk``: like ``training`` without the pause, with a file writer that needs 50 ms per
  record (a slow or busy disk), so the writer is behind when the process dies;
* ``merge`` (format parquet): on the writer thread, when the first merged file is in place and
  the step files it replaces are not yet deleted.

Parquet windows are merged every ``step_count_per_record`` steps here, so that merges happen
while the run goes on (the product merges per 100 steps).
"""

from __future__ import annotations

import os
import signal
import time

import torch

from monitor import TrainerMon
from tests.reliability.training import EVERYTHING, Net, make_batches

#: loss spikes: AnomalyNan(threshold) reports them, so anomaly.json is replaced again and again.
SPIKES = (1, 4, 7, 10)
GRAD_ACC = 2
#: pause before a kill on the training thread (the rest of a real step's compute).
STEP_PAUSE_S = 0.2


def config(fmt: str) -> dict:
    return {
        **EVERYTHING,
        "format": fmt,
        "step_count_per_record": 4,  # files roll over while the run goes on
        "alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 1e4}}], "dump": True},
    }


def _file_writer_class(fmt: str) -> type:
    if fmt == "csv":
        from monitor.writers.csv import CsvWriter

        return CsvWriter
    if fmt == "parquet":
        from monitor.writers.parquet import ParquetWriter

        ParquetWriter.merge_steps = config(fmt)["step_count_per_record"]
        return ParquetWriter
    from monitor.writers.tensorboard import TensorBoardWriter

    return TensorBoardWriter


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def run(out_dir: str, fmt: str, kill_step: int, where: str) -> None:
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    torch.set_num_threads(1)
    writer = _file_writer_class(fmt)
    write = writer.write
    seen = {"records": 0}

    def write_then_die(self, record):
        write(self, record)
        if record.step == kill_step:
            seen["records"] += 1
            if seen["records"] == 3:
                _kill()

    def slow_write(self, record):
        time.sleep(0.05)
        write(self, record)

    if where == "merge":
        writer._remove_merged = staticmethod(lambda paths: _kill())
    if where == "writer":
        writer.write = write_then_die
    elif where == "slow_disk":
        writer.write = slow_write
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = TrainerMon(config(fmt))
    mon.set_monitor(model, grad_acc_steps=GRAD_ACC, optimizer=optimizer)
    for step, batches in enumerate(make_batches(kill_step + 3, GRAD_ACC, seed=5)):
        for x in batches:
            (model(x).pow(2).mean() * (1e6 if step in SPIKES else 1.0)).backward()
        if step == kill_step and where == "training":
            time.sleep(STEP_PAUSE_S)
            _kill()
        if step == kill_step and where == "slow_disk":
            _kill()
        optimizer.step()
        optimizer.zero_grad()
    time.sleep(30)  # the writer thread's kill comes while it writes step kill_step
    os._exit(3)  # not killed: the parent sees exit code 3 instead of SIGKILL
