"""A real local HTTP endpoint, incidents as the tracker builds them, and the waits the alert tests share."""

from __future__ import annotations

import http.server
import json
import threading
import time

from monitor import load_config
from monitor.alerts.dispatch import Alerts
from monitor.anomaly.incidents import Incident

TOKEN = "s3cret-token-value"


def incident(step: int = 7, rank: int = 0, number: int = 1) -> Incident:
    root = {
        "tag_name": f"0:layers.1.weight/rank{rank}/post_grad",
        "op": "norm",
        "value": float("nan"),
        "baseline": 0.5,
        "rule": "AnomalyNan",
    }
    return Incident(number, rank, step, 0, root, ["root first", "2 ranks"])


class Server:
    """A local HTTP endpoint: answers ``status`` (a list is used up first) with ``answer`` as its
    body after ``delay`` seconds, or hangs in ``hang``; ``location``: the redirect's target.
    ``paths`` holds each request's path and query, ``requests`` its headers and JSON body,
    ``arrivals`` the monotonic time it came in."""

    def __init__(
        self,
        statuses=(200,),
        hang: bool = False,
        delay: float = 0.0,
        answer: bytes = b"",
        location: str = "",
    ) -> None:
        self.requests: list[tuple[dict, dict]] = []
        self.paths: list[str] = []
        self.arrivals: list[float] = []
        self.statuses = list(statuses)
        self.hang = hang
        self.delay = delay
        self.answer = answer
        self.location = location
        self.inside = threading.Event()
        self.release = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                server.arrivals.append(time.monotonic())
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                server.requests.append((dict(self.headers), body))
                server.paths.append(self.path)
                if server.hang:
                    server.inside.set()
                    server.release.wait(30)
                time.sleep(server.delay)
                status = server.statuses.pop(0) if len(server.statuses) > 1 else server.statuses[0]
                self.send_response(status)
                if server.location:
                    self.send_header("Location", server.location)
                self.send_header("Content-Length", str(len(server.answer)))
                self.end_headers()
                self.wfile.write(server.answer)

            do_GET = do_POST

            def log_message(self, *args):
                pass

        class Quiet(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass  # a client that gave up (the sink's timeout) closed the connection first

        self.httpd = Quiet(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def alerts_of(config: dict, rank: int, root, actions=()) -> Alerts:
    alert = load_config({"alert": {"sinks": config}}).alert
    return Alerts(alert.sinks, actions, rank, str(root))


def wait_for(condition, seconds: float = 10.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``seconds`` pass (False)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def lines(path) -> list[dict]:
    """The complete JSON lines of a file sink (a line being written is left out)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]
