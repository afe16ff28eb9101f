"""The optional C extension; everything else about the package is in pyproject.toml.

``optional=True``: where no C compiler is available the install still succeeds and
monitor.fused_stats falls back to one library call per statistic.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "monitor._fused_stats",
            sources=["monitor/_fused_stats.c"],
            extra_compile_args=["-O3", "-std=c11"],
            optional=True,
        )
    ]
)
