"""Where an incident message goes: a webhook, a program, a JSON-lines file, a Python callback.

Each sink's ``deliver(message)`` makes one attempt and raises on failure; retries, rate limits and
the thread it runs on belong to ``monitor.alerts.dispatch``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection
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


def _signature(key: str, text: str) -> str:
    return base64.b64encode(hmac.new(key.encode(), text.encode(), hashlib.sha256).digest()).decode()


def signed(url: str, body: dict[str, Any], preset: str, secret: str) -> tuple[str, dict[str, Any]]:
    """The URL and body of a message to a chat robot that requires signing (its "signature"
    security setting): DingTalk takes a millisecond timestamp and the HMAC-SHA256 of
    "timestamp\\nsecret" keyed by the secret in the query; Feishu takes a second timestamp and the
    HMAC-SHA256 of nothing keyed by "timestamp\\nsecret" in the body."""
    if not secret:
        return url, body
    if preset == "dingtalk":
        stamp = str(int(time.time() * 1000))
        sign = urllib.parse.quote_plus(_signature(secret, f"{stamp}\n{secret}"))
        return f"{url}{'&' if '?' in url else '?'}timestamp={stamp}&sign={sign}", body
    stamp = str(int(time.time()))
    return url, {**body, "timestamp": stamp, "sign": _signature(f"{stamp}\n{secret}", "")}


def rejection(preset: str, answer: bytes) -> str | None:
    """Why a chat tool refused a message it answered with HTTP 200 (Feishu and DingTalk say so in
    the body: a wrong keyword, signature or IP filter), or None where it took it."""
    if preset not in ("feishu", "dingtalk"):
        return None
    try:
        body = json.loads(answer)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    for code_key, text_key in (("errcode", "errmsg"), ("code", "msg"), ("StatusCode", "StatusMessage")):
        code = body.get(code_key)
        if code not in (None, 0, "0"):
            return f"{preset} refused the message: {code_key} {code} ({str(body.get(text_key, ''))[:160]})"
    return None


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

    return urllib.request.build_opener(HTTPHandler, HTTPSHandler, _NoRedirect)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is a failure: urllib would follow it as a GET without the message, and carry the
    authorization headers to whichever host the answer names."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class WebhookSink:
    """HTTP POST of the message as JSON; any answer but 2xx is a failure, and so is an answer
    not complete within ``timeout_s`` of the start. Failures name the HTTP status or the kind of
    error only: the URL may hold a token."""

    def __init__(self, spec: SinkSpec) -> None:
        self.spec = spec

    def deliver(self, message: Message) -> None:
        # the URL and secrets are read from their variables now (a rotated token is picked up)
        url, content = signed(
            self.spec.resolved_url(), payload(message, self.spec.preset), self.spec.preset, self.spec.secret()
        )
        body = json.dumps(content, allow_nan=False, default=str).encode("utf-8")
        try:
            request = urllib.request.Request(
                url,
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
                    answer = response.read(_ANSWER_BYTES)
                    left = response.length  # bytes of a declared length not read (None: none declared)
                if (left and len(answer) < _ANSWER_BYTES) or (left is None and deadline.expired):
                    raise TimeoutError  # the deadline shut the socket down: a cut-off answer
            except urllib.error.HTTPError as exc:
                if 300 <= exc.code < 400:
                    raise OSError(
                        f"HTTP {exc.code}, a redirect: not followed (the message and its headers go to "
                        "the configured URL only; give the URL it redirects to)"
                    ) from None
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
        refused = rejection(self.spec.preset, answer)
        if refused:
            raise OSError(refused)


#: the most of an answer read: a chat tool's verdict is a short JSON object
_ANSWER_BYTES = 1 << 16


class CommandSink:
    """Runs ``argv`` (no shell) with the message as JSON on stdin; a non-zero exit is a failure.
    The program runs in a process group of its own, which a timeout ends whole (a script's
    children too, so a late page cannot follow the retry), and without the environment variables
    that hold the webhooks' secrets (``hidden``). One still running when the run ends is ended
    the same way (``abandon``): it was started in a session of its own, which nothing else ends;
    after that no program starts (a retry under way would otherwise start one that outlives the
    run)."""

    def __init__(self, spec: SinkSpec, hidden: Collection[str] = ()) -> None:
        self.spec = spec
        self.hidden = frozenset(hidden)
        self._running: subprocess.Popen | None = None
        #: held while a program starts, so that ``abandon`` sees it or prevents it
        self._starting = threading.Lock()
        self._abandoned = False

    def abandon(self) -> None:
        """End the program under way, if any, with its process group, and start none after it
        (called from another thread)."""
        with self._starting:
            self._abandoned = True
            process = self._running
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except OSError:  # gone already
                pass

    def deliver(self, message: Message) -> None:
        text = json.dumps(message, allow_nan=False, default=str)
        environment = {k: v for k, v in os.environ.items() if k not in self.hidden}
        with self._starting:
            if self._abandoned:
                raise OSError("not started: the run has ended")
            try:
                process = subprocess.Popen(
                    list(self.spec.argv),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    env=environment,
                    start_new_session=True,
                )
            except OSError as exc:  # not its message: it quotes the whole command line
                raise OSError(f"cannot start the program ({exc.strerror or type(exc).__name__})") from None
            self._running = process
        try:
            _, error_text = process.communicate(text.encode("utf-8"), timeout=self.spec.timeout_s)
        except subprocess.TimeoutExpired:
            _end_group(process)
            raise OSError(f"no exit within timeout_s ({self.spec.timeout_s:g} s)") from None
        finally:
            self._running = None
        if process.returncode != 0:
            error = error_text.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
            raise OSError(f"{_ending(process.returncode)} {error[0][:200]}".rstrip())


def _ending(returncode: int) -> str:
    """How a program that failed ended: its exit status, or the signal that ended it (a negative
    return code, as subprocess reports it)."""
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        return f"ended by signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"ended by signal {-returncode}"


def _end_group(process: subprocess.Popen) -> None:
    """Kill the program's whole process group, then collect the program."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:  # gone already
        pass
    try:
        process.communicate(timeout=1.0)
    except subprocess.TimeoutExpired:  # a descendant that left the group holds its stderr open
        for pipe in (process.stdin, process.stderr):
            if pipe is not None:
                pipe.close()
        process.wait()


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


def open_sink(
    spec: SinkSpec, root: str, hidden: Collection[str] = ()
) -> WebhookSink | CommandSink | FileSink:
    """The sink object of one ``alert.sinks`` entry; ``hidden``: the variables a command must not see."""
    if spec.type == "webhook":
        return WebhookSink(spec)
    if spec.type == "command":
        return CommandSink(spec, hidden)
    return FileSink(spec, root)
