"""The README's examples, run as written: the quick start with its minimal config, and the
console line it shows for the demo's incident. Taken from the README itself, so it cannot drift
from what works."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
#: the quick start's placeholder for the user's own forward and backward
PLACEHOLDER = "...  # forward/backward per micro-batch as usual"


def readme_block(language: str, containing: str) -> str:
    """The README's first fenced ``language`` block (any fence for "") that contains ``containing``."""
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", README, re.S | re.M):
        if lang == language and containing in body:
            return body
    raise AssertionError(f"README has no {language or 'plain'} block containing {containing!r}")


def test_the_quick_start_records_the_gradients_the_optimizer_steps_with(tmp_path, monkeypatch):
    code = readme_block("python", "mon.set_monitor(")
    assert PLACEHOLDER in code, "the quick start's forward/backward placeholder changed"
    (tmp_path / "monitor_config.json").write_text(readme_block("json", '"targets"'))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MONITOR_OUTPUT_DIR")  # the README's default output directory
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = [torch.randn(4, 8) for _ in range(12)]  # three steps of four micro-batches
    stepped: list[dict[str, float]] = []  # the independent read: the gradients each step applies

    def read_gradients(*_: object) -> None:
        stepped.append({n: float(np.linalg.norm(p.grad.numpy())) for n, p in model.named_parameters()})

    optimizer.register_step_pre_hook(read_gradients)
    exec(  # the README's own code
        code.replace(PLACEHOLDER, "model(batch).square().mean().backward()"),
        {"model": model, "optimizer": optimizer, "loader": loader},
    )
    (rank_dir,) = (tmp_path / "monitor_output").glob("*-rank0-*")
    written = {path.name.split("_0-")[0] for path in rank_dir.glob("*.csv")}
    assert {"grad_reduced", "grad_unreduced", "exp_avg", "exp_avg_sq"} <= written
    frame = pd.concat(pd.read_csv(path) for path in rank_dir.glob("grad_reduced_*.csv"))
    assert sorted(set(frame["step"])) == [0, 1, 2]
    assert len(stepped) == 3  # the optimizer's gradients were read at every step
    for step, norms in enumerate(stepped):
        rows = frame[frame["step"] == step].set_index("name")["norm"]
        assert dict(rows) == pytest.approx(norms, rel=1e-5)


def test_the_console_line_shown_is_what_the_demo_prints(tmp_path):
    first, second = readme_block("", "incident 1 at step").strip().splitlines()
    demo = subprocess.run(
        [sys.executable, "-m", "monitor.cli", "demo", "--output", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    (printed,) = [line for line in demo.stderr.splitlines() if "incident 1 at step" in line]
    assert printed.startswith(first.strip() + " ")
    shown = second.strip().removesuffix("...").strip()
    assert printed[len(first.strip()) + 1 :].startswith(shown)
