"""Where an incident message goes: a webhook, a program, a JSON-lines file, a Python callback.

Each sink's ``deliver(message)`` makes one attempt and raises on failure; retries, rate limits and
the thread it runs on belong to ``monitor.alerts.dispatch``.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from monitor.alerts.config import SinkSpec
from monitor.files import FILE_MODE, make_private_dir

Message = dict[str, Any]


def payload(message: Message, preset: str) -> dict[str, Any]:
    """The JSON body a webhook preset posts: the message itself, or a chat tool's text message."""
    if preset == "json":
        return message
    text = message["summary"]
    if preset == "slack":
        return {"text": text}
    if preset == "feishu":
        return {"msg_type": "text", "content": {"text": text}}
    return {"msgtype": "text", "text": {"content": text}}  # dingtalk


class _Deadline:
    """Ends a request that is still running ``seconds`` after it began, whatever it waits for:
    a socket timeout bounds each read only, so an endpoint that trickles a byte now and then
    would hold the sink forever. The connections urllib opens report their sockets here; at the
    deadline they are shut down, which wakes a blocked read with an error."""

    def __init__(self, seconds: float) -> None:
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            expired = self._expired
        if expired:
            self._shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self._expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            self._shut(sock)

    @property
    def expired(self) -> bool:
        return self._expired

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already


def _opener(deadline: _Deadline) -> urllib.request.OpenerDirector:
    """urllib's opener (proxies from the environment included) whose connections ``deadline`` watches."""

    def watched(base: type) -> type:
        class Connection(base):
            def connect(self) -> None:
                super().connect()
                deadline.watch(self.sock)

        return Connection

    http_connection = watched(http.client.HTTPConnection)
    https_connection = watched(http.client.HTTPSConnection)

    class HTTPHandler(urllib.request.HTTPHandler):
        def http_open(self, req: urllib.request.Request) -> Any:
            return self.do_open(http_connection, req)

    class HTTPSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req: urllib.request.Request) -> Any:
            return self.do_open(https_connection, req, context=self._context)

    return urllib.request.build_opener(HTTPHandler, HTTPSHandler)


class WebhookSink:
    """HTTP POST of the message as JSON; any answer but 2xx is a failure, and so is an answer
    not complete within ``timeout_s`` of the start. Failures name the HTTP status or the kind of
    error only: the URL may hold a token."""

    def __init__(self, spec: SinkSpec) -> None:
        self.spec = spec

    def deliver(self, message: Message) -> None:
        body = json.dumps(payload(message, self.spec.preset), allow_nan=False, default=str).encode("utf-8")
        try:  # the URL is read from its variable now (a rotated token is picked up)
            request = urllib.request.Request(
                self.spec.resolved_url(),
                data=body,
                method="POST",
                headers={"Content-Type": "application/json", **self.spec.headers()},
            )
        except ValueError:  # not its message: it quotes the URL, which may hold a token
            raise OSError(f"the URL is not usable now (is {self.spec.url_env or 'url'} still set?)") from None
        with _Deadline(self.spec.timeout_s) as deadline:
            try:
                with _opener(deadline).open(request, timeout=self.spec.timeout_s) as response:
                    status = response.status
                    response.read()
            except urllib.error.HTTPError as exc:
                raise OSError(f"HTTP {exc.code}") from None
            except (OSError, ValueError, http.client.HTTPException) as exc:
                reason = getattr(exc, "reason", exc)  # not the message: it may quote the URL and its token
                if deadline.expired or isinstance(reason, TimeoutError):
                    raise OSError(
                        f"no complete answer within timeout_s ({self.spec.timeout_s:g} s)"
                    ) from None
                raise OSError(f"cannot reach the endpoint ({type(reason).__name__})") from None
        if not 200 <= status < 300:
            raise OSError(f"HTTP {status}")


class CommandSink:
    """Runs ``argv`` (no shell) with the message as JSON on stdin; a non-zero exit is a failure."""

    def __init__(self, spec: SinkSpec) -> None:
        self.spec = spec

    def deliver(self, message: Message) -> None:
        text = json.dumps(message, allow_nan=False, default=str)
        try:
            done = subprocess.run(
                list(self.spec.argv),
                input=text.encode("utf-8"),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=self.spec.timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:  # not its message: it quotes the whole command line
            raise OSError(f"no exit within timeout_s ({self.spec.timeout_s:g} s)") from None
        if done.returncode != 0:
            error = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
            raise OSError(f"exit status {done.returncode} {error[0][:200]}".rstrip())


class FileSink:
    """Appends one JSON line per message (one write, so lines of several ranks never interleave)."""

    def __init__(self, spec: SinkSpec, root: str) -> None:
        self.path = os.path.join(root, spec.path)  # an absolute path stays as it is

    def deliver(self, message: Message) -> None:
        make_private_dir(os.path.dirname(self.path))  # the path's directories, where missing
        line = (json.dumps(message, allow_nan=False, default=str) + "\n").encode("utf-8")
        flags = (
            os.O_WRONLY
            | os.O_APPEND
            | os.O_CREAT
            | getattr(os, "O_NOFOLLOW", 0)
            | getattr(os, "O_CLOEXEC", 0)
        )
        fd = os.open(self.path, flags, FILE_MODE)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


class CallbackSink:
    """A Python callable given to ``TrainerMon.on_incident``; it receives the message dict."""

    def __init__(self, callback: Callable[[Message], Any]) -> None:
        self.callback = callback

    def deliver(self, message: Message) -> None:
        self.callback(message)


def open_sink(spec: SinkSpec, root: str) -> WebhookSink | CommandSink | FileSink:
    """The sink object of one ``alert.sinks`` entry."""
    if spec.type == "webhook":
        return WebhookSink(spec)
    if spec.type == "command":
        return CommandSink(spec)
    return FileSink(spec, root)
