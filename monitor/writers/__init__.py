"""Writers behind one small interface (``write(record)``, ``close()``), fed off the training thread."""

from monitor.writers.api import ApiWriter
from monitor.writers.base import Writer, WriterThread
from monitor.writers.csv import CsvWriter

__all__ = ["ApiWriter", "CsvWriter", "Writer", "WriterThread"]
