"""Helpers for the MindSpore adapter tests: small networks, a training loop that keeps copies."""

from __future__ import annotations

import itertools

import mindspore as ms
import numpy as np
from mindspore import nn, ops

OPTIMIZERS = {
    "Adam": lambda params: nn.Adam(params, learning_rate=0.05),
    "AdamWeightDecay": lambda params: nn.AdamWeightDecay(params, learning_rate=0.05, weight_decay=0.01),
    "Lamb": lambda params: nn.Lamb(params, learning_rate=0.05),
}
#: the attributes where each optimizer keeps (exp_avg, exp_avg_sq), read by the tests on their own.
MOMENTS = {
    "Adam": ("moment1", "moment2"),
    "AdamWeightDecay": ("moments1", "moments2"),
    "Lamb": ("moments1", "moments2"),
}


class Net(nn.Cell):
    """Dense layers of different shapes, a ReLU and a LayerNorm."""

    def __init__(self, sizes=(6, 16, 12, 4), seed: int = 0) -> None:
        super().__init__()
        self.layers = nn.CellList([nn.Dense(a, b) for a, b in itertools.pairwise(sizes)])
        self.act = nn.ReLU()
        self.norm = nn.LayerNorm((sizes[-1],))
        rng = np.random.default_rng(seed)
        for _, param in self.parameters_and_names():  # deterministic, independent of MindSpore's seed
            param.set_data(ms.Tensor(rng.normal(0.0, 0.5, param.shape).astype(np.float32)))

    def construct(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.act(x)
        return self.norm(x)


def make_batches(steps: int, micro: int, seed: int = 1, features: int = 6, batch: int = 5):
    rng = np.random.default_rng(seed)
    return [
        [rng.normal(size=(batch, features)).astype(np.float32) for _ in range(micro)] for _ in range(steps)
    ]


#: the attention network's sequence length, heads and head size
SEQ, HEADS, DIM = 6, 2, 4


class CoreAttention(nn.Cell):
    """Causal attention of (batch, seq, heads, dim) Q, K, V."""

    def construct(self, q, k, v):
        scores = ops.matmul(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1)) / np.sqrt(DIM)
        mask = ms.Tensor(np.triu(np.full((SEQ, SEQ), -1e9, np.float32), 1))
        return ops.matmul(ops.softmax(scores + mask, -1), v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


class AttentionNet(nn.Cell):
    """Q, K, V from one Dense, a core attention Cell on (batch, seq, heads, dim), a Dense out."""

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        hidden = HEADS * DIM
        self.qkv = nn.Dense(hidden, 3 * hidden)
        self.attention = CoreAttention()
        self.out = nn.Dense(hidden, 5)
        for _, param in self.parameters_and_names():
            param.set_data(ms.Tensor(rng.normal(0.0, 0.5, param.shape).astype(np.float32)))

    def construct(self, x):
        b = x.shape[0]
        q, k, v = ops.split(self.qkv(x), HEADS * DIM, -1)
        q, k, v = (t.reshape(b, SEQ, HEADS, DIM) for t in (q, k, v))
        return self.out(self.attention(q, k, v).reshape(b, SEQ, HEADS * DIM))


def copies(tensors) -> list[np.ndarray]:
    return [np.array(t.asnumpy(), copy=True) for t in tensors]


def train(net, optimizer, batches, capture: list | None = None, moments: tuple[str, str] | None = None):
    """Train with gradient accumulation over each step's micro-batches; optionally keep numpy copies.

    Per step ``capture`` gets a dict: ``micro`` (each micro-batch's gradients), ``grads`` (what the
    optimizer is called with: their sum), ``param_origin``, ``param_updated`` and, with ``moments``,
    ``exp_avg_before``, ``exp_avg``, ``exp_avg_sq`` -- all in the optimizer's parameter order.
    """
    grad_fn = ms.value_and_grad(lambda x: net(x).square().mean(), None, optimizer.parameters)
    losses = []
    for step_batches in batches:
        total, micro = None, []
        for x in step_batches:
            loss, grads = grad_fn(ms.Tensor(x))
            losses.append(float(loss.asnumpy()))
            if capture is not None:
                micro.append(copies(grads))
            total = grads if total is None else tuple(a + g for a, g in zip(total, grads))
        record = {}
        if capture is not None:
            record = {"micro": micro, "grads": copies(total), "param_origin": copies(optimizer.parameters)}
            if moments:
                record["exp_avg_before"] = copies(getattr(optimizer, moments[0]))
        optimizer(total)
        if capture is not None:
            record["param_updated"] = copies(optimizer.parameters)
            if moments:
                record["exp_avg"] = copies(getattr(optimizer, moments[0]))
                record["exp_avg_sq"] = copies(getattr(optimizer, moments[1]))
            capture.append(record)
    return losses


def jit_training(net: nn.Cell) -> tuple[nn.Optimizer, object]:
    """Adam, and a training step compiled with ``mindspore.jit`` in PyNative mode (forward,
    backward and update in one compiled function)."""
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)

    def loss_of(x, y):
        return ((net(x) - y) ** 2).mean()

    grad_fn = ms.value_and_grad(loss_of, None, optimizer.parameters)

    @ms.jit
    def train_step(x, y):
        loss, grads = grad_fn(x, y)
        optimizer(grads)
        return loss

    return optimizer, train_step
