"""The checkpoint and stop actions on 2 MindSpore ranks (msrun, CPU): a fault on rank 1 alone
stops both ranks at the same step, after both called the checkpoint function there."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

from tests.adapters.mindspore.msrun import run_msrun
from tests.adapters.mindspore.stop_worker import AT, STEPS

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stop_worker.py")


@pytest.mark.distributed
def test_both_ranks_checkpoint_and_stop_at_the_same_step(tmp_path):
    run_msrun(WORKER, tmp_path, 2)
    results = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in (0, 1)]
    steps = {result["stopped"][0] for result in results}
    assert len(steps) == 1
    step = steps.pop()
    assert AT < step < STEPS and [r["last_step"] for r in results] == [step - 1, step - 1]
    assert [r["checkpoints"] for r in results] == [[step], [step]]
    assert (
        "another rank" in results[0]["stopped"][1] and f"at step {AT} on rank 1" in results[1]["stopped"][1]
    )
