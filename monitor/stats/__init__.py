"""How the numbers are computed on the host: the one-pass C kernel (``_fused_stats.c``, built at
install), its Python face with the fallback (``fused_stats``), and the statistics of host arrays
derived from the kernel's partial results (``host_stats``).

Imports nothing else of ``monitor``: numpy only, so any adapter and any reader can use it.
"""
