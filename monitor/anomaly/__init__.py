"""Anomalies, during the run and after it: the rules and the detector that apply them to each
step's records (``rules``, with ``zscore`` and what rules share in ``rule_cells``;
``detector``, with how a data type's norms moved together in ``moves``), incidents with their
roots and the per-rank anomaly files (``incidents``, ``root``, ``incident_files``,
``anomaly_files``, ``dump``), and the readers behind
``anomaly-analyse`` and its cross-rank comparison (``analyse``, ``ordering``, ``cross_rank``,
``windows``, ``peers``, ``peer_rows`` with its C kernel ``_peer_rows``, ``peers_sql``,
``rank_csv``, ``verdicts``, ``report``, ``workers``).

May import the config, the data types' tag tasks, the TensorBoard event files (the dump's
format), the live Parquet layout (a run written with ``format: parquet``) and the shared modules
at the top of ``monitor``.
"""
