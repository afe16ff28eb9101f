"""Writers behind one small interface (``write(record)``, ``close()``), fed off the training thread
(``base``): CSV (``csv``, with its C row formatter ``_csv_rows``), TensorBoard event files
(``tensorboard``, framed by ``eventfile``, its Custom Scalars layout in ``custom_scalars``),
Parquet (``parquet``, its file layout in ``parquet_files``) and in memory (``api``).

May import the data types' tag tasks (for file and tag names) and the shared modules at the top
of ``monitor``; nothing of a session or of the anomaly side.
"""

from monitor.writers.api import ApiWriter
from monitor.writers.base import Writer, WriterThread
from monitor.writers.csv import CsvWriter

__all__ = ["ApiWriter", "CsvWriter", "Writer", "WriterThread"]
