"""The training's own errors stay the training's where a read of the monitor's surfaces them.

MindSpore runs kernels asynchronously and reports a failing one once, at the first read of its
result. tests/adapters/mindspore/test_lifecycle.py has a real failing kernel (a bfloat16 reduction,
which has no CPU kernel) surface in the monitor's gradient hook. At the reads below a real one
cannot be arranged on CPU (MindSpore reads the forward's tensors itself before a Cell's forward
hook runs, and its CPU optimizers either support a dtype or refuse it at once), so a stand-in read
raises MindSpore's RuntimeError once, as MindSpore does; the monitor must raise it on to the
training rather than take it for a fault of its own, log it and read again.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

import mindspore as ms
import numpy as np
from mindspore import nn

from monitor import TrainerMon
from tests.adapters.mindspore.helpers import Net

FAILURE = "Reduce does not support this kernel data type (a stand-in for the training's failed kernel)"


def _fails_once(read):
    """``read``, raising MindSpore's RuntimeError at its first call, as MindSpore reports once."""
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(FAILURE)
        return read(*args, **kwargs)

    return stand_in


_ATTENTION_READ_FAILS = """
import numpy as np, mindspore as ms
from mindspore import nn
from monitor import TrainerMon
from tests.adapters.mindspore.helpers import DIM, HEADS, SEQ, AttentionNet
from tests.adapters.mindspore.test_training_errors import _fails_once

net = AttentionNet()
net.set_train(True)
optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
config = {
    "recording_l2_features": True,
    "l2_targets": {"attention_hook": ["attention"], "linear_hook": []},
    "sa_order": "b,s,h,d",
    "format": "api",
}
TrainerMon(config).set_monitor(net, 1, optimizer)
ms.Tensor.asnumpy = _fails_once(ms.Tensor.asnumpy)  # the attention rows' read is the first
step = ms.value_and_grad(lambda x: net(x).square().mean(), None, optimizer.parameters)
try:
    step(ms.Tensor(np.ones((2, SEQ, HEADS * DIM), np.float32)))
    print("trained")
except RuntimeError as exc:
    print("raised", str(exc).splitlines()[0])
"""


def test_a_failure_surfaced_by_the_attention_rows_reaches_the_training(tmp_path):
    """In a process of its own: MindSpore's autograd is left unusable when a forward fails (and it
    writes its analysis of the failure under the working directory)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    done = subprocess.run(
        [sys.executable, "-c", _ATTENTION_READ_FAILS],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": root, "MONITOR_OUTPUT_DIR": str(tmp_path)},
    )
    assert done.stdout.strip().splitlines()[-1:] == [f"raised {FAILURE}"], done.stdout + done.stderr[-2000:]
    assert "attention_hook attention failed" not in done.stderr


def test_a_failure_surfaced_by_the_moments_measured_together_reaches_the_training(monkeypatch, trainmon_log):
    """After the update both moments are measured in one call, whose read is the first after the
    optimizer's kernels: what it surfaces must not be measured again and written."""
    net = Net()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    mon = TrainerMon({"mv_distribution": True, "format": "api"}).set_monitor(net, 1, optimizer)
    step = ms.value_and_grad(lambda x: net(x).square().mean(), None, optimizer.parameters)
    _, grads = step(ms.Tensor(np.ones((4, 6), np.float32)))
    monkeypatch.setattr(ms.Tensor, "asnumpy", _fails_once(ms.Tensor.asnumpy))
    with pytest.raises(RuntimeError, match="Reduce does not support"):
        optimizer(grads)
    assert mon._latest("exp_avg") == {}
    assert not [r for r in trainmon_log.records if "failed" in r.getMessage()]
    mon.stop()
