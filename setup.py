"""The optional C extensions; everything else about the package is in pyproject.toml.

``optional=True``: where no C compiler is available the install still succeeds,
monitor.stats.fused_stats falls back to one library call per statistic, the CSV writer to Python's
formatting and the cross-rank analysis to numpy partitions.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "monitor.stats._fused_stats",
            sources=["monitor/stats/_fused_stats.c"],
            extra_compile_args=["-O3", "-std=c11"],
            optional=True,
        ),
        Extension(
            "monitor.anomaly._peer_rows",
            sources=["monitor/anomaly/_peer_rows.c"],
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        ),
        Extension(
            "monitor.writers._csv_rows",
            sources=["monitor/writers/_csv_rows.c"],
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        ),
    ]
)
