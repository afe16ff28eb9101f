"""``alert.sinks`` and ``alert.actions``: their keys, defaults and validation.

Secrets (a webhook URL holding a token, authorization headers, a chat robot's signing secret) are
never written in the config: it names environment variables (``url_env``, ``headers_env``,
``secret_env``) read when the config is loaded, and no output or log line shows their values.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from monitor.config.values import (
    ConfigError,
    as_int,
    as_number,
    as_str_list,
    describe,
    kind_of,
    not_one_of,
    unknown_key,
)
from monitor.files import output_root

SINK_TYPES = ("webhook", "command", "file")
#: message shapes a webhook can post: the incident itself, or a chat tool's text message.
PRESETS = ("json", "slack", "feishu", "dingtalk")
#: which ranks deliver: the lowest rank that saw the incident, rank 0 only, or every rank.
RANK_CHOICES = ("lowest", "rank0", "all")
ACTIONS = ("stop", "checkpoint", "skip_step")
_COMMON = ("type", "ranks", "timeout_s", "retries", "backoff_s", "cooldown_s", "max_per_hour")
SINK_KEYS = {
    "webhook": (*_COMMON, "url", "url_env", "preset", "headers_env", "secret_env"),
    "command": (*_COMMON, "argv"),
    "file": (*_COMMON, "path"),
}


@dataclass(frozen=True)
class SinkSpec:
    """One ``alert.sinks`` entry (``type`` decides which of the fields below apply)."""

    type: str
    #: webhook: the URL, given directly or read from the environment variable ``url_env``.
    url: str = ""
    url_env: str = ""
    preset: str = "json"
    #: webhook: header name -> environment variable holding its value.
    headers_env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    #: webhook (feishu, dingtalk): the variable holding the robot's signing secret.
    secret_env: str = ""
    #: command: the program and its arguments (no shell); the message arrives on its stdin.
    argv: tuple[str, ...] = ()
    #: file: JSON lines appended here (a relative path is under the output root).
    path: str = ""
    ranks: str = "lowest"
    timeout_s: float = 10.0
    retries: int = 3
    backoff_s: float = 1.0
    #: seconds after a delivery during which further messages are dropped (and counted).
    cooldown_s: float = 0.0
    max_per_hour: int = 30

    def to_dict(self, for_outputs: bool = False) -> dict[str, Any]:
        """The entry as written in a config (only its type's keys; secrets stay in the environment).
        ``for_outputs``: a URL given in the config is cut to its scheme and host, as a chat tool's
        webhook URL holds its token."""
        keys = [key for key in SINK_KEYS.get(self.type, _COMMON) if key not in ("url", "url_env")]
        plain = {key: getattr(self, key) for key in keys}
        if self.type == "webhook":
            url = f"{self._endpoint()}/..." if for_outputs else self.url
            plain.update({"url_env": self.url_env} if self.url_env else {"url": url})
            plain["headers_env"] = dict(self.headers_env)
            if self.secret_env:
                plain["secret_env"] = self.secret_env
            else:
                plain.pop("secret_env", None)
        if self.type == "command":
            plain["argv"] = list(self.argv)
        return plain

    def resolved_url(self) -> str:
        """The webhook URL (from ``url_env`` where given)."""
        return os.environ.get(self.url_env, "") if self.url_env else self.url

    def headers(self) -> dict[str, str]:
        """The webhook's extra headers, read from their environment variables.

        Raises:
            OSError: a variable is unset or empty now (a message sent without its token would be
                refused, or worse, taken by an endpoint that does not check it), or holds a line
                break or a control character (said as at load, not as an unreachable endpoint).
        """
        unset = [variable for variable in self.headers_env.values() if not os.environ.get(variable)]
        if unset:
            raise OSError(f"the header variable {unset[0]} is not set now; not sent without it")
        for variable in self.headers_env.values():
            if not _one_printable_line(os.environ[variable]):
                raise OSError(
                    f"the value of {variable} holds a line break or a control character now; not sent"
                )
        return {name: os.environ[variable] for name, variable in self.headers_env.items()}

    def secret(self) -> str:
        """The signing secret (from ``secret_env``; empty: messages are not signed)."""
        return os.environ.get(self.secret_env, "") if self.secret_env else ""

    def variables(self) -> tuple[str, ...]:
        """The environment variables holding this sink's secrets."""
        return tuple(v for v in (self.url_env, *self.headers_env.values(), self.secret_env) if v)

    def _endpoint(self) -> str:
        """The webhook URL's scheme, host and port: no path or query, which may hold a token."""
        parts = urlsplit(self.resolved_url())
        return f"{parts.scheme}://{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")

    def label(self, index: int) -> str:
        """How logs name the sink: its type, place and a target without secrets."""
        if self.type == "webhook":
            target = self._endpoint()
        elif self.type == "command":
            target = os.path.basename(self.argv[0])
        else:
            target = self.path
        return f"alert.sinks[{index}] ({self.type} {target})"


def parse_sinks(value: Any) -> tuple[SinkSpec, ...]:
    """``alert.sinks``: a list of sink objects."""
    if not isinstance(value, list):
        raise ConfigError(f"alert.sinks: expected a list of sinks, got {describe(value)}")
    return tuple(_sink(spec, f"alert.sinks[{i}]") for i, spec in enumerate(value))


@dataclass(frozen=True)
class BundleSpec:
    """``alert.bundle``: evidence bundles for the first ``incidents`` incidents of each rank."""

    incidents: int = 1
    max_mb: float = 64.0

    def to_dict(self) -> dict[str, Any]:
        return {"incidents": self.incidents, "max_mb": self.max_mb}


BUNDLE_KEYS = ("incidents", "max_mb")


def parse_bundle(value: Any) -> BundleSpec | None:
    """``alert.bundle``: ``{"incidents": N, "max_mb": M}``; absent or null: no bundles."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(
            f"alert.bundle: expected an object with 'incidents' and 'max_mb', got {describe(value)}"
        )
    for key in value:
        if key not in BUNDLE_KEYS:
            raise unknown_key(f"alert.bundle.{key}", str(key), BUNDLE_KEYS)
    return BundleSpec(
        incidents=as_int(value.get("incidents", 1), "alert.bundle.incidents", 1, 1000),
        max_mb=as_number(value.get("max_mb", 64.0), "alert.bundle.max_mb", positive=True),
    )


def parse_actions(value: Any) -> tuple[str, ...]:
    """``alert.actions``: what the run does on an incident."""
    actions = as_str_list(value, "alert.actions")
    for i, action in enumerate(actions):
        if action not in ACTIONS:
            raise not_one_of(f"alert.actions[{i}]", action, ACTIONS)
    return tuple(dict.fromkeys(actions))


#: the longest wait a sink's timing keys take (a larger one is a typo, and overflows a timer)
_HOUR = 3600.0


def _sink(spec: Any, path: str) -> SinkSpec:
    kind = kind_of(spec, path, "type", SINK_TYPES, "an object with 'type'")
    for key in spec:
        if key not in SINK_KEYS[kind]:
            raise unknown_key(f"{path}.{key}", str(key), SINK_KEYS[kind], f"unknown key for a {kind} sink")
    ranks = spec.get("ranks", "lowest")
    if ranks not in RANK_CHOICES:
        raise not_one_of(f"{path}.ranks", ranks, RANK_CHOICES)
    common = {
        "ranks": ranks,
        "timeout_s": as_number(
            spec.get("timeout_s", 10.0), f"{path}.timeout_s", positive=True, at_most=_HOUR
        ),
        "retries": as_int(spec.get("retries", 3), f"{path}.retries", 0, 10),
        "backoff_s": as_number(spec.get("backoff_s", 1.0), f"{path}.backoff_s", at_most=_HOUR),
        "cooldown_s": as_number(spec.get("cooldown_s", 0.0), f"{path}.cooldown_s", at_most=24 * _HOUR),
        "max_per_hour": as_int(spec.get("max_per_hour", 30), f"{path}.max_per_hour", 1),
    }
    if kind == "webhook":
        return SinkSpec(kind, **_webhook(spec, path), **common)
    if kind == "command":
        argv = as_str_list(spec.get("argv"), f"{path}.argv")
        if not argv or not argv[0]:
            raise ConfigError(f"{path}.argv: expected the program and its arguments, got {describe(argv)}")
        if _may_deliver_here(ranks) and shutil.which(argv[0]) is None:  # said now, not hours into the run
            raise ConfigError(
                f"{path}.argv[0]: {argv[0]!r} is not a program found here; expected an executable "
                "file's path, or a program's name on PATH"
            )
        return SinkSpec(kind, argv=argv, **common)
    target = spec.get("path")
    if not isinstance(target, str) or not target or target.endswith("/") or os.path.normpath(target) == ".":
        raise ConfigError(f"{path}.path: expected the path of a file, got {describe(target)}")
    if not os.path.isabs(target) and os.path.normpath(target).split(os.sep)[0] == os.pardir:
        raise ConfigError(
            f"{path}.path: {target!r} leaves the output root; expected a path under it, or an "
            "absolute path for a place outside it"
        )
    where = os.path.join(output_root(), target)  # an absolute path stays as it is
    if os.path.isdir(where):
        raise ConfigError(f"{path}.path: {target!r} is a directory; expected the path of a file (in it, say)")
    if _may_deliver_here(ranks):
        problem = _unwritable(where)
        if problem:  # said now, not at the first incident hours into the run
            raise ConfigError(
                f"{path}.path: {target!r} cannot be written: {problem}; expected a writable place"
            )
    return SinkSpec(kind, path=target, **common)


def _unwritable(where: str) -> str:
    """Why the file at ``where`` could not be appended to (its missing directories are created at
    the first message), or "" when it could; nothing is created here."""
    if os.path.exists(where):
        return "" if os.access(where, os.W_OK) else "the file is not writable"
    parent = os.path.dirname(os.path.abspath(where))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent!r} is a file, not a directory"
    return "" if os.access(parent, os.W_OK | os.X_OK) else f"the directory {parent!r} is not writable"


def _may_deliver_here(ranks: str) -> bool:
    """Whether this process may deliver a sink's messages: any rank may, but a ``rank0`` sink is
    delivered by rank 0 alone, so another rank (as its launcher numbers it: torchrun's RANK,
    MindSpore's RANK_ID) need not have its program installed (the head node's pager, say)."""
    launched = os.environ.get("RANK", os.environ.get("RANK_ID", "0")).strip()
    return ranks != "rank0" or launched in ("", "0")


def _webhook(spec: dict, path: str) -> dict[str, Any]:
    url, url_env = spec.get("url", ""), spec.get("url_env", "")
    if bool(url) == bool(url_env):
        raise ConfigError(f"{path}: expected exactly one of 'url' and 'url_env' (an environment variable)")
    if url_env:
        url = _environment(url_env, f"{path}.url_env")
    elif not isinstance(url, str):
        raise ConfigError(f"{path}.url: expected an http(s) URL, got {describe(url)}")
    problem = _url_problem(url)
    if problem:
        shown = _url_shown(url) if not url_env else f"the value of {url_env}"
        raise ConfigError(
            f"{path}.url: expected an http:// or https:// URL without spaces, credentials or a bad "
            f"port, got {shown}: {problem}"
        )
    preset = spec.get("preset", "json")
    if preset not in PRESETS:
        raise not_one_of(f"{path}.preset", preset, PRESETS)
    headers = spec.get("headers_env", {})
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        raise ConfigError(
            f"{path}.headers_env: expected an object of header name -> environment variable, "
            f"got {describe(headers)}"
        )
    for name, variable in headers.items():
        if not _HEADER_NAME.fullmatch(str(name)):
            raise ConfigError(
                f"{path}.headers_env: expected header names of letters, digits and -, got {describe(name)}"
            )
        value = _environment(variable, f"{path}.headers_env.{name}")
        if not _one_printable_line(value):
            raise ConfigError(
                f"{path}.headers_env.{name}: the value of {variable} holds a line break or a control "
                "character; expected one line of printable text"
            )
    secret_env = spec.get("secret_env", "")
    if secret_env:
        if preset not in _SIGNED:
            raise ConfigError(
                f"{path}.secret_env: only the {' and '.join(_SIGNED)} presets sign their messages, "
                f"got preset {preset!r}"
            )
        _environment(secret_env, f"{path}.secret_env")
    return {
        "url": "" if url_env else url,
        "url_env": url_env,
        "preset": preset,
        "headers_env": MappingProxyType(dict(headers)),
        "secret_env": secret_env,
    }


#: presets whose robots can require signed messages (a secret set in the chat tool)
_SIGNED = ("feishu", "dingtalk")
#: an HTTP header name (a token of RFC 9110)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: an environment variable's name, as shells write it
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: a name quoted back in an error: the usual upper-case form; a chat robot's secret pasted in
#: its place (DingTalk's SEC and hex digits, Feishu's mixed case) is a valid name, yet no such
#: name, and is not shown
_SHOWN_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,63}")


def _one_printable_line(value: str) -> bool:
    """Whether a header value is one line of printable ASCII (tabs allowed), as HTTP takes it."""
    return all(32 <= ord(c) < 127 or c == "\t" for c in value)


def _url_shown(url: str) -> str:
    """A refused URL as its error shows it: the scheme and host only, since its path, query and
    any user:password may hold a token, and errors go to the job's logs."""
    try:
        parts = urlsplit(url)
        scheme, host = parts.scheme, parts.hostname or ""
    except ValueError:  # an unclosed IPv6 bracket
        scheme = host = ""
    if not (scheme and host):
        return "a URL not shown (it may hold a token)"
    return f"{scheme}://{host}/... (the rest not shown: it may hold a token)"


def _url_problem(url: str) -> str:
    """Why a webhook URL cannot be posted to, in words that quote none of it ("" when it can):
    http(s), a host, a port in range (urllib raises on a bad one only when it is read), no
    user:password (urllib would take it for the host), no space or control character."""
    if not all(33 <= ord(c) < 127 for c in url):
        return "it holds a space, a control character or a non-ASCII one"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (read for the ValueError of a port out of range or not a number)
    except ValueError:  # an unclosed IPv6 bracket, a bad port
        return "its host or port cannot be read (a port out of range, an unclosed [ of an IPv6 host)"
    if parts.scheme not in ("http", "https"):
        return "it does not begin with http:// or https://"
    if not parts.hostname:
        return "it names no host"
    if parts.username is not None:
        return "it holds a user name or password (give a token in a header, headers_env)"
    return ""


def _environment(variable: Any, path: str) -> str:
    """The value of the environment variable named at ``path``. A value that is not a name is
    not quoted back: it may be the secret itself, pasted where its variable's name belongs."""
    if not isinstance(variable, str) or not variable:
        raise ConfigError(f"{path}: expected the name of an environment variable, got {describe(variable)}")
    if not _VARIABLE_NAME.fullmatch(variable):
        bare = variable.strip("${}")
        hint = f"; write {bare!r}, without $ or braces" if _SHOWN_NAME.fullmatch(bare) else ""
        raise ConfigError(
            f"{path}: expected the name of an environment variable (letters, digits and _, not "
            f"starting with a digit), got a value that is not one (not shown: it may be a secret){hint}"
        )
    value = os.environ.get(variable)
    if not value:
        named = variable if _SHOWN_NAME.fullmatch(variable) else "named there (not shown: it may be a secret)"
        raise ConfigError(f"{path}: the environment variable {named} is not set")
    return value
