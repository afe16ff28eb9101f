"""Reading a config file as data: JSON, or YAML (by extension) with the safe loader.

Only the parsing lives here; what the values mean and how they are checked is monitor.config.schema's.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from monitor.config.values import ConfigError, warn


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a config file as data only (JSON, or YAML with the safe loader by extension)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise ConfigError(f"config file {path!r}: cannot be read ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path!r}: expected UTF-8 text") from None
    return parse_config_text(text, path, is_yaml_path(path))


def is_yaml_path(path: str) -> bool:
    """Whether a config file of this name is YAML (else JSON)."""
    return path.lower().endswith((".yaml", ".yml"))


def parse_config_text(text: str, source: str, is_yaml: bool) -> dict[str, Any]:
    """A config file's text as data (``source`` names it in errors): JSON, or YAML with the safe loader."""
    try:
        data = _load_yaml(text) if is_yaml else json.loads(text, object_pairs_hook=_said_duplicates)
    except Exception as exc:
        raise ConfigError(
            f"config file {source!r}: not valid {'YAML' if is_yaml else 'JSON'}: {_without_text(exc)}"
        ) from None
    if data is None:  # a YAML file of comments only: no key set, as "{}" in JSON
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {source!r}: expected an object at the top level, got {type(data).__name__}"
        )
    return data


def _without_text(exc: Exception) -> str:
    """A parser's error without the lines of the file it quotes (YAML's do: a secret pasted into
    the file where a variable's name belongs would be printed into the logs)."""
    problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if problem is None or mark is None:
        return str(exc)
    context = getattr(exc, "context", None)
    return f"{f'{context}: ' if context else ''}{problem} at line {mark.line + 1}, column {mark.column + 1}"


def _said_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's pairs as a dict, the last value of a repeated key kept (as JSON readers keep
    it), and said."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            warn("key %r appears twice in one object; the last value is used", key)
        data[key] = value
    return data


def _load_yaml(text: str) -> Any:
    """YAML with the safe loader, reading floats the YAML 1.2 / JSON way (``1e-8`` is a number)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            keys = [self.construct_object(key, deep=True) for key, _ in node.value]
            for key in {k for k in keys if isinstance(k, str) and keys.count(k) > 1}:
                warn("key %r appears twice in one mapping; the last value is used", key)
            return super().construct_mapping(node, deep=deep)

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )
    return yaml.load(text, Loader=Loader)  # a SafeLoader subclass: data only
