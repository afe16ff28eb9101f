"""The query layer: DuckDB under every reader of the monitor's outputs.

``engine`` opens the connections (one database per process, a cursor per read, the memory limit
of ``monitor.memory_limit``); ``csv_files`` reads the per-rank CSV files with every reader's rules
(complete lines only, rows that do not parse left out and counted); ``parquet_values`` reads the
live Parquet files. The cross-rank analysis, the dashboards, ``csv2tb``, ``csv2db`` and
``trainmon compact`` read through them. It imports only the layout of the live Parquet files
(monitor.writers.parquet_files) and the regular-file check (monitor.writers.eventfile).
"""
