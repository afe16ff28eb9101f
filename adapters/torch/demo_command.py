"""``trainmon demo``: its options and what it prints (registered with the ``trainmon`` command
through the ``trainmon.commands`` entry points)."""

from __future__ import annotations

import argparse
import glob
import os
import sys
from collections.abc import Callable
from importlib import resources

from monitor.config.values import did_you_mean

DEMO_TEMPLATE = "everything_alerts.yaml"


def template_path(name: str) -> str:
    """Path of a file shipped in config_templates/."""
    return str(resources.files("config_templates").joinpath(name))


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``demo`` to the ``trainmon`` command's sub-commands."""
    _add_demo(sub)


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    """An argparse type: one of ``choices``, naming the closest one when misspelt."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"expected one of {', '.join(choices)}, got {text!r}{did_you_mean(text, choices)}"
            )
        return text

    return parse


def _add_demo(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo",
        help="train a small GPT-like model on CPU with the monitor attached and a gradient spike injected",
        description="Train a small GPT-like model (synthetic tokens, AdamW, gradient accumulation 2) "
        "with TrainerMon attached, inject one gradient spike, and report what the monitor found.",
    )
    demo.add_argument("--steps", type=_int_at_least(1), default=50, help="optimizer steps (default 50)")
    demo.add_argument(
        "--output",
        default=None,
        help="output root (default: $MONITOR_OUTPUT_DIR or ./monitor_output)",
    )
    demo.add_argument(
        "--format",
        type=_one_of(("csv", "tensorboard", "parquet")),
        metavar="{csv,tensorboard,parquet}",
        default=None,
        help="output format (default csv)",
    )
    spike = demo.add_mutually_exclusive_group()
    spike.add_argument(
        "--spike-step",
        type=_int_at_least(0),
        default=None,
        help="step of the injected spike (default: three fifths of --steps, 30 of 50)",
    )
    spike.add_argument("--no-spike", action="store_true", help="do not inject a gradient spike")
    demo.add_argument(
        "--config", default=None, help=f"config file (default config_templates/{DEMO_TEMPLATE})"
    )
    demo.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from adapters.torch.demo import run_demo
    from monitor.anomaly.root import describe_root
    from monitor.config.values import ConfigError

    config = args.config or template_path(DEMO_TEMPLATE)
    spike_step = None if args.no_spike else args.spike_step
    if spike_step is None and not args.no_spike:
        spike_step = args.steps * 3 // 5
    if spike_step is not None and spike_step >= args.steps:
        print(f"trainmon demo: --spike-step {spike_step} is not below --steps {args.steps}", file=sys.stderr)
        return 2
    try:
        summary = run_demo(
            config, steps=args.steps, spike_step=spike_step, output=args.output, fmt=args.format
        )
    except (ConfigError, OSError) as exc:  # a bad config or output directory: one line, no traceback
        message = str(exc)
        print(message if message.startswith("trainmon") else f"trainmon demo: {message}", file=sys.stderr)
        return 2
    anomalies = summary["anomalies"]
    print()
    stopped = " at the step the run stopped" if summary["stopped"] else ""
    print(
        f"Trained {summary['parameters']:,}-parameter GPT-like model for {summary['steps']} steps "
        f"in {summary['seconds']:.1f} s (loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}"
        f"{stopped})."
    )
    if summary["stopped"]:
        print(f"Stopped:     {summary['stopped']}")
    print(f"Config:      {config}")
    print(f"Outputs:     {summary['output_dir']}")
    anomaly_dir = os.path.join(summary["root"], "anomaly_detected") if summary["root"] else ""
    if os.path.isdir(anomaly_dir):
        print(f"Anomalies:   {anomaly_dir}")
    if spike_step is not None:
        print(f"Injected:    a x1000 loss (gradient) spike at step {spike_step}")
    incidents = summary["incidents"]
    if not summary["recorded"]:
        print("Detected:    nothing could be: the config records no data type (see the warning above)")
    elif incidents:
        print(f"Detected:    {len(incidents)} incident(s), {len(anomalies)} anomaly record(s)")
        for incident in incidents[:5]:
            print(
                f"  incident {incident.id} at step {incident.onset_step}: {describe_root(incident.root)}; "
                f"{incident.distinct_tensors} tensor(s) in {len(incident.data_types)} data type(s), "
                f"{incident.state}"
            )
            for line in incident.evidence:
                print(f"    - {line}")
    elif spike_step is not None and spike_step < summary["first_judged_step"]:
        first = summary["first_judged_step"]  # a later spike, in more steps if they end before it
        advice = (
            f"--spike-step {first} or later"
            if first < args.steps
            else f"--steps {first + 10} --spike-step {first}"
        )
        print(
            f"Detected:    no anomalies: the spike at step {spike_step} came before the rules had "
            f"values enough to compare it with (their warm-up); try {advice}"
        )
    else:
        print("Detected:    no anomalies")
    if incidents and os.path.isdir(anomaly_dir):
        print(f"Next:        trainmon anomaly-analyse -d {summary['root']}")
        for bundle in sorted(glob.glob(os.path.join(anomaly_dir, "rank*", "bundle_incident*")))[:1]:
            print(f"             trainmon bundle show {bundle}   (the evidence kept)")
    if os.path.isdir(os.path.join(summary["output_dir"], "values")):  # format: parquet
        pattern = os.path.join(summary["root"], "*", "values", "*", "*.parquet")
        print(f"Query it:    SELECT * FROM read_parquet('{pattern}', hive_partitioning = true)  -- DuckDB")
    else:
        print(f"Look at it:  tensorboard --logdir {summary['root']}")
        if glob.glob(os.path.join(summary["output_dir"], "*.csv")):  # the trainmon tab reads CSV as is
            print("             (the trainmon tab reads the CSV as it is; for the Scalars tab,")
            print(f"             run trainmon csv2tb {summary['root']} first)")
    return 0
