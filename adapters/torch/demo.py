"""`trainmon demo`: a small GPT-like model trained on synthetic tokens with TrainerMon attached.

It injects one gradient spike (the loss of one micro-batch scaled up) at a chosen step so that
the anomaly rules have something real to find, then reports where everything went.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from monitor import CollectivesLogged, StructurePrinted, TrainerMon, TrainingStopped
from monitor.anomaly.rules import build_rules
from monitor.config.schema import load_config
from monitor.session.lifecycle import recorded_kinds


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the demo model (defaults: about 0.2M parameters, ~30 ms a step on one CPU thread)."""

    vocab: int = 512
    hidden: int = 64
    heads: int = 4
    layers: int = 3
    seq: int = 32


class CoreAttention(nn.Module):
    """Causal attention of (batch, sequence, heads, head size) queries, keys and values: the
    module an ``l2_targets.attention_hook`` entry names (``sa_order: "b,s,h,d"``)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return out.transpose(1, 2)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.attention = CoreAttention()
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.norm2 = nn.LayerNorm(cfg.hidden)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.hidden, 4 * cfg.hidden), nn.GELU(), nn.Linear(4 * cfg.hidden, cfg.hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads) for z in (q, k, v))
        x = x + self.proj(self.attention(q, k, v).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, transformer blocks, final norm, LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab, cfg.hidden)
        self.position = nn.Parameter(torch.zeros(cfg.seq, cfg.hidden))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.final_norm = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) + self.position[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.final_norm(x))


def synthetic_batch(
    cfg: GPTConfig, batch: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens following a noisy fixed pattern, so the loss really goes down."""
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=generator)
    steps = torch.arange(cfg.seq + 1).unsqueeze(0)
    tokens = (start + 7 * steps) % cfg.vocab
    noise = torch.rand(tokens.shape, generator=generator) < 0.1
    tokens = torch.where(noise, torch.randint(0, cfg.vocab, tokens.shape, generator=generator), tokens)
    return tokens[:, :-1], tokens[:, 1:]


def run_demo(
    config_path: str,
    steps: int = 50,
    spike_step: int | None = 30,
    spike_scale: float = 1000.0,
    output: str | None = None,
    fmt: str | None = None,
    grad_acc_steps: int = 2,
    seed: int = 0,
) -> dict:
    """Train the demo model with the monitor attached; returns a summary for the CLI to print.

    A stop the config asked for (an alert action ``stop``, ``cc_log_only``, ``print_struct``) ends
    the training early and is told in the summary's ``stopped``.
    """
    if output:
        os.environ["MONITOR_OUTPUT_DIR"] = os.path.abspath(output)
    config = load_config(config_path)
    if fmt:
        config = load_config({**config.to_dict(), "format": fmt})
    torch.set_num_threads(1)  # small model: one thread is fastest and steady on a shared machine
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    cfg = GPTConfig()
    model = TinyGPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    monitor = TrainerMon(config)
    monitor.set_monitor(model, grad_acc_steps=grad_acc_steps, optimizer=optimizer)
    losses: list[float] = []
    started = time.perf_counter()
    try:
        _train(model, optimizer, cfg, generator, steps, grad_acc_steps, spike_step, spike_scale, losses)
        stopped = None
    except (TrainingStopped, CollectivesLogged, StructurePrinted) as stop:
        stopped = str(stop)
    elapsed = time.perf_counter() - started
    monitor.stop()
    return {
        "output_dir": monitor.output_dir,
        "root": os.path.dirname(monitor.output_dir) if monitor.output_dir else None,
        "anomalies": monitor.anomalies,
        "incidents": monitor.incidents,
        "losses": losses,
        "seconds": elapsed,
        "steps": len(losses),
        "stopped": stopped,
        "recorded": recorded_kinds(monitor.config),
        "first_judged_step": _first_judged_step(monitor.config),
        "parameters": sum(p.numel() for p in model.parameters()),
        "first_loss": losses[0] if losses else math.nan,
        "last_loss": losses[-1] if losses else math.nan,
    }


def _first_judged_step(config: Any) -> int:
    """The first step a configured rule can flag a finite value at: the shortest warm-up of
    collected values among the rules that have one (AnomalyNan flags only NaN/Inf), from
    ``start_step`` every ``step_interval`` steps."""
    warmups = [rule.warmup for rule in build_rules(config.alert.rules) if hasattr(rule, "warmup")]
    return config.start_step + min(warmups, default=0) * config.step_interval


def _train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: GPTConfig,
    generator: torch.Generator,
    steps: int,
    grad_acc_steps: int,
    spike_step: int | None,
    spike_scale: float,
    losses: list[float],
) -> None:
    """The demo's training loop; each step's loss is appended to ``losses`` as it ends."""
    for step in range(steps):
        total = 0.0
        for _ in range(grad_acc_steps):
            tokens, targets = synthetic_batch(cfg, 8, generator)
            logits = model(tokens)
            loss = (
                nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))
                / grad_acc_steps
            )
            if spike_step is not None and step == spike_step:
                loss = loss * spike_scale  # the injected gradient spike
            loss.backward()
            total += loss.detach().item()
        losses.append(total)  # the step's losses were computed whether or not a stop follows
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
