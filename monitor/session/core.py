"""The framework-free half of a monitoring session: outputs, detection, the latest values.

An adapter computes StepRecords on the training thread and hands them to ``submit``; at the end
of a collected step it calls ``end_step``. Everything after that (anomaly rules, CSV,
TensorBoard, anomaly.json) runs on the writer thread.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from monitor.anomaly.detector import Anomaly, Detector
from monitor.anomaly.dump import AnomalyDump
from monitor.anomaly.incidents import AnomalySink, Incident
from monitor.anomaly.rules import build_rules
from monitor.config.schema import MonitorConfig
from monitor.files import OUTPUT_ENV, find_rank_dir, make_private_dir, output_root, rank_dir_name
from monitor.record import StepRecord
from monitor.run_info import write_run_info
from monitor.writers.api import ApiWriter
from monitor.writers.base import WriterThread
from monitor.writers.csv import CsvWriter

logger = logging.getLogger("trainmon")


class MonitorCore:
    """Per-rank outputs and detection for one TrainerMon.

    Args:
        config: the validated config.
        rank: global rank (0 without a process group).
        pp_stage: this rank's index in the pipeline group, for anomaly records.
        group_mates: ranks of the pipeline group, for anomaly records.
        root: output root; MONITOR_OUTPUT_DIR or ./monitor_output when None.
        output_dir: an existing rank directory to continue (a restart within the same run): its
            files are appended to and its anomaly records kept.
        info: the run-info document (``monitor.run_info.run_info``) written into the rank directory.
    """

    def __init__(
        self,
        config: MonitorConfig,
        rank: int,
        pp_stage: int = 0,
        group_mates: list[int] | None = None,
        root: str | None = None,
        output_dir: str | None = None,
        info: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.root = root or output_root()
        self.latest = ApiWriter()
        self.anomalies: list[Anomaly] = []
        self.output_dir: str | None = None
        self.file_writer = None
        self.detector: Detector | None = None
        self._anomaly_sink: AnomalySink | None = None
        #: whether append_output found this rank's directory of an earlier run to go on in
        self._resumed = False
        sinks: list = []
        if config.format != "api":
            self.output_dir = output_dir or self._rank_dir()
            self.file_writer = self._file_writer()
            if info is not None:
                topology = {"pp_stage": pp_stage, "group_mates": list(group_mates or [rank])}
                config_facts = {"config": config.to_dict(for_outputs=True)}
                write_run_info(self.output_dir, {**info, **topology, **config_facts})
            sinks.append(self.file_writer)
            if config.format == "tensorboard":
                from monitor.writers.custom_scalars import CustomScalarsSink

                roots = dict(enumerate(info.get("root_modules", []))) if info else {}
                sinks.append(CustomScalarsSink(self.output_dir, roots))
        if config.alert.rules or config.alert.non_finite:
            keep = output_dir is not None or self._resumed  # the same run goes on: its files too
            dump = (
                AnomalyDump(self.root, rank, keep=keep, owner=self.output_dir or "")
                if config.alert.dump
                else None
            )
            self.detector = Detector(
                build_rules(config.alert.rules), rank, pp_stage, group_mates, config.alert.non_finite
            )
            world_size = info.get("world_size") if info is not None else None
            self._anomaly_sink = AnomalySink(self.detector, dump, keep=self.anomalies, world_size=world_size)
            sinks.append(self._anomaly_sink)
        self._writer = WriterThread(sinks)

    def continue_incidents(self, earlier: MonitorCore) -> None:
        """Number incidents on from an earlier collection of the same run (``start()`` after
        ``stop()``, a live reconfiguration), as the anomaly files do with ``alert.dump``."""
        if self._anomaly_sink is not None and earlier._anomaly_sink is not None:
            tracker = self._anomaly_sink.tracker
            tracker.next_id = max(tracker.next_id, earlier._anomaly_sink.tracker.next_id)

    def _rank_dir(self) -> str:
        try:
            make_private_dir(self.root)
        except OSError as exc:  # a file in the way, no permission: said at the door, naming the setting
            where = (
                f"{OUTPUT_ENV}={os.environ[OUTPUT_ENV]!r}"
                if os.environ.get(OUTPUT_ENV)
                else "./monitor_output"
            )
            raise OSError(
                f"trainmon: the output directory {self.root!r} ({where}) cannot be made: "
                f"{exc.strerror or str(exc).removeprefix('trainmon: ')}; expected a directory this "
                "process may write in"
            ) from exc
        path = None
        if self.config.append_output:
            path = find_rank_dir(self.root, self.rank, *self.config.append_output)
            if path is None:
                logger.warning(
                    "trainmon: append_output %s: no directory of rank %d in range under %s; starting anew",
                    list(self.config.append_output),
                    self.rank,
                    self.root,
                )
        self._resumed = path is not None
        return make_private_dir(path or os.path.join(self.root, rank_dir_name(self.rank)), under=self.root)

    def _file_writer(self):
        if self.config.format == "tensorboard":
            from monitor.writers.tensorboard import TensorBoardWriter

            return TensorBoardWriter(self.output_dir)
        if self.config.format == "parquet":
            from monitor.writers.parquet import ParquetWriter

            return ParquetWriter(self.output_dir, self.rank)
        return CsvWriter(self.output_dir, self.config.ndigits, self.config.step_count_per_record)

    @property
    def incidents(self) -> list:
        """This session's incidents so far (after the writer has processed them; see ``flush``)."""
        return list(self._anomaly_sink.tracker.incidents) if self._anomaly_sink is not None else []

    def on_incident(self, handler: Callable[[Incident], None]) -> None:
        """Call ``handler(incident)`` on the writer thread when an incident opens (errors contained)."""
        if self._anomaly_sink is not None:
            self._anomaly_sink.on_open = handler

    def submit_batch_ids(self, step: int, step_ids: list) -> None:
        """The ids of each micro-batch of ``step``, for the incidents that begin at it."""
        sink = self._anomaly_sink
        if sink is not None:
            self._writer.call(lambda: sink.note_batch_ids(step, step_ids))

    def abnormal_now(self, timeout: float) -> bool:
        """Whether the records submitted so far for the current step hold an abnormal value
        (waits up to ``timeout`` seconds for the writer to judge them; False if it could not)."""
        if self._anomaly_sink is None:
            return False
        if not self.flush(timeout):
            logger.warning(
                "trainmon: the writer did not judge the step within %.0f s; it is not skipped", timeout
            )
            return False
        return self._anomaly_sink.tracker.has_abnormal

    def submit(self, record: StepRecord) -> None:
        """Hand one data type's statistics of a collected step to the outputs (training thread)."""
        self.latest.write(record)
        self._writer.submit(record)

    def submit_histograms(self, step: int, tags: list[str], edges: Any, counts: Any) -> None:
        """Histograms (TensorBoard only): ``counts`` rows are bucket counts then NaN and Inf counts
        (or a function giving them, called on the writer thread)."""
        writer = self.file_writer
        if not hasattr(writer, "write_histogram"):
            return

        def write() -> None:
            for tag, row in zip(tags, counts() if callable(counts) else counts):
                writer.write_histogram(step, tag, edges, row[:-2], nan_count=row[-2], inf_count=row[-1])

        self._writer.call(write)

    def end_step(self, step: int) -> None:
        """The collected step is complete: rows are flushed and anomaly.json replaced."""
        self._writer.end_step(step)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is written (at most ``timeout`` seconds);
        whether it was."""
        return self._writer.flush(timeout)

    def close(self) -> None:
        """Drain and close the outputs; values stay readable through ``latest``."""
        self._writer.close()
