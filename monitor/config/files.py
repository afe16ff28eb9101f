"""Reading a config file as data: JSON, or YAML (by extension) with the safe loader.

Only the parsing lives here; what the values mean and how they are checked is monitor.config.schema's.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from monitor.config.values import ConfigError


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
        data = _load_yaml(text) if is_yaml else json.loads(text)
    except Exception as exc:
        raise ConfigError(
            f"config file {source!r}: not valid {'YAML' if is_yaml else 'JSON'}: {exc}"
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {source!r}: expected an object at the top level, got {type(data).__name__}"
        )
    return data


def _load_yaml(text: str) -> Any:
    """YAML with the safe loader, reading floats the YAML 1.2 / JSON way (``1e-8`` is a number)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )
    return yaml.load(text, Loader=Loader)  # a SafeLoader subclass: data only
