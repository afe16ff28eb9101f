"""What each data type records and what it calls a row: the data types and their tag tasks
(``tasks``), the per-parameter rows (``params``), module inputs and outputs (``modules``), the
update histograms (``update_ratio``) and msprobe's l2 features (``l2``).

May import the config and the shared modules at the top of ``monitor`` (``naming``, ``record``).
"""
