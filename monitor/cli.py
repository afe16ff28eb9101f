"""The ``trainmon`` command: ``anomaly-analyse`` and ``bundle`` here, and the sub-commands the
adapters and dashboards register (``demo``, ``csv2tb``, ``csv2db``) through entry points, so that
the framework-free core imports neither."""

from __future__ import annotations

import argparse
import os
import sys

#: entry-point group of the sub-commands registered by the adapters and dashboards.
COMMAND_GROUP = "trainmon.commands"


def _version() -> str:
    """The installed package's version (the source tree's when it is not installed)."""
    from importlib import metadata

    try:
        return metadata.version("trainmon")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def _add_anomaly_analyse(sub: argparse._SubParsersAction) -> None:
    from monitor.anomaly import analyse

    parser = sub.add_parser(
        "anomaly-analyse",
        help="rank the anomalies of all ranks to find the first one",
        description=analyse.DESCRIPTION,
        epilog=analyse.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    analyse.add_arguments(parser)
    parser.set_defaults(run=analyse.run)


def _add_bundle(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bundle",
        help="show what an incident's evidence bundle holds",
        description="Show an evidence bundle (alert.bundle): the incident, where it ran, and each "
        "tensor with its shape, range and NaN count. In Python: "
        "monitor.alerts.bundle.load_bundle(DIR).tensors.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    show = actions.add_parser("show", help="summarise a bundle directory")
    show.add_argument("directory", help="a bundle_incident{N} directory under anomaly_detected/rank{R}")
    show.set_defaults(run=_bundle_show)


def _bundle_show(args: argparse.Namespace) -> int:
    from monitor.alerts.bundle import describe_bundle, load_bundle

    try:
        print(describe_bundle(load_bundle(args.directory)))
    except ValueError as exc:
        print(f"trainmon bundle show: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _add_registered(sub: argparse._SubParsersAction, first: bool) -> bool:
    """Sub-commands that other parts of the package register under the ``trainmon.commands``
    entry points (the demo from the torch adapter, the converters from dashboards): the core
    never imports them. ``first``: only ``demo``; else every other one, by name. Returns whether
    any entry point was found (none where the package is not installed, only on the path)."""
    from importlib import metadata

    found = sorted(metadata.entry_points(group=COMMAND_GROUP), key=lambda entry: entry.name)
    for entry in found:
        if (entry.name == "demo") == first:
            try:
                entry.load()(sub)
            except Exception as exc:  # one broken part must not take the other commands down
                print(
                    f"trainmon: warning: the {entry.name!r} commands are unavailable ({exc!r})",
                    file=sys.stderr,
                )
    return bool(found)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainmon", description="Training-state monitor tools.")
    parser.add_argument("--version", action="version", version=f"trainmon {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    installed = _add_registered(sub, first=True)
    _add_anomaly_analyse(sub)
    _add_bundle(sub)
    _add_registered(sub, first=False)
    if not installed:
        parser.epilog = (
            "demo, csv2tb, csv2db and compact are registered by the installed package and are "
            "missing here: install it (pip install -e . in the source tree)"
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``trainmon`` console script. Output piped into a reader that stops
    early (``| head``) ends the command quietly, as other command-line tools do."""
    parser = build_parser()
    given = sys.argv[1:] if argv is None else argv
    if not given:  # the commands and what each does, rather than argparse's one-line complaint
        parser.print_help(sys.stderr)
        return 2
    commands = next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if not given[0].startswith("-") and given[0] not in commands:
        from monitor.config.values import did_you_mean

        hint = did_you_mean(given[0], commands)
        if hint:  # argparse's own message lists the commands but suggests none
            parser.error(f"argument COMMAND: invalid choice: {given[0]!r}{hint}")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser: its usage, and the option meant
        _refuse_unknown(commands[args.command], unknown)
    try:
        return args.run(args)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return 141  # the shell's code for a command ended by SIGPIPE


def _refuse_unknown(command: argparse.ArgumentParser, unknown: list[str]) -> None:
    """Exit 2 with the command's usage, naming the arguments it does not take and, for a
    misspelt option, the one meant (argparse says it under the top-level usage, without it)."""
    from monitor.config.values import did_you_mean

    options = [o for action in command._actions for o in action.option_strings if o.startswith("--")]
    first = next((u.split("=", 1)[0] for u in unknown if u.startswith("--")), "")
    hint = did_you_mean(first, options) if first else ""
    command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


if __name__ == "__main__":
    sys.exit(main())
