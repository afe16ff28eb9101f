"""Reading back what a monitored run wrote into its output directory (csv format)."""

from __future__ import annotations

import os

import pandas as pd


def collected_steps(output_dir: str, prefix: str = "grad_reduced") -> list[int]:
    """The steps found in the rows of the csv files whose names start with ``prefix`` ("" for all)."""
    frames = [
        pd.read_csv(os.path.join(output_dir, f))
        for f in os.listdir(output_dir)
        if f.startswith(prefix) and f.endswith(".csv")
    ]
    return sorted(set(pd.concat(frames)["step"])) if frames else []


def window_starts(output_dir: str, prefix: str = "grad_reduced") -> list[int]:
    """The first step of each ``{prefix}_{first}-{last}.csv`` file, in order."""
    return sorted(
        int(f.split("_")[-1].split("-")[0])
        for f in os.listdir(output_dir)
        if f.startswith(prefix) and f.endswith(".csv")
    )
