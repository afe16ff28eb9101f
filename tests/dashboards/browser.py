"""Real servers for the front-end tests: TensorBoard, and headless Chromium driven over WebDriver.

No selenium: chromedriver speaks the W3C WebDriver protocol over HTTP, and the few calls the tests
need (open a page, switch into the plugin's iframe, run a script, take a screenshot) are plain
JSON requests made here with urllib. Every process is started here and stopped by its PID.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

#: Chromium and its driver: TRAINMON_CHROMIUM / TRAINMON_CHROMEDRIVER where set (an install
#: without root, in a home directory), else the Debian packages' paths.
CHROMIUM = os.environ.get("TRAINMON_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("TRAINMON_CHROMEDRIVER", "/usr/bin/chromedriver")
INSTALL = (
    "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver; "
    "without root, point TRAINMON_CHROMIUM and TRAINMON_CHROMEDRIVER at a Chromium and a "
    "chromedriver of the same version"
)
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"


def missing_browser() -> str | None:
    """Why the browser tests cannot run here, or None."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.path.exists(path):
            return f"{path} is not installed (install with: {INSTALL})"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the process by its PID, then SIGKILL if it does not end within 10 s."""
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(10)


def _wait(check, timeout: float, what: str, process: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {process.returncode}")
        try:
            result = check()
        except (OSError, ValueError):
            result = None
        if result:
            return result
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not ready after {timeout} s")


@contextmanager
def tensorboard(logdir: str, log_path: str):
    """``tensorboard --logdir LOGDIR --host 127.0.0.1 --port P``; yields its base URL."""
    port = free_port()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorboard.main",
                "--logdir",
                logdir,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--reload_interval",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: http_get(f"{base}/data/plugins_listing")[0] == 200, 60, "tensorboard", process)
        yield base
    finally:
        _stop(process)


class Browser:
    """A WebDriver session on headless Chromium."""

    def __init__(self, driver: str, profile: str) -> None:
        self.driver = driver
        options = {
            "binary": CHROMIUM,
            "args": [
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--window-size=1400,900",
                f"--user-data-dir={profile}",
            ],
        }
        answer = self._call(
            "POST",
            "/session",
            {
                "capabilities": {
                    "alwaysMatch": {
                        "browserName": "chrome",
                        "goog:chromeOptions": options,
                        "goog:loggingPrefs": {"browser": "ALL"},
                    }
                }
            },
        )
        self.session = f"/session/{answer['sessionId']}"

    def _call(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.driver + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())["value"]
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"webdriver {method} {path}: {exc.read()[:500]!r}") from None

    def open(self, url: str) -> None:
        self._call("POST", f"{self.session}/url", {"url": url})

    def script(self, source: str, *args):
        """Run ``source`` (a function body; ``arguments`` holds args) in the current frame."""
        return self._call("POST", f"{self.session}/execute/sync", {"script": source, "args": list(args)})

    def wait_for(self, source: str, timeout: float = 30.0, what: str = "page"):
        """Poll ``source`` until it returns something truthy."""
        return _wait(lambda: self.script(source), timeout, what)

    def enter_frame(self, css: str) -> None:
        element = self.wait_for(f"return document.querySelector({json.dumps(css)});", what=css)
        self._call("POST", f"{self.session}/frame", {"id": {ELEMENT: element[ELEMENT]}})

    def leave_frames(self) -> None:
        self._call("POST", f"{self.session}/frame", {"id": None})

    def console_errors(self) -> list[str]:
        """Messages of the browser console at level SEVERE (script errors, failed requests) so far."""
        entries = self._call("POST", f"{self.session}/se/log", {"type": "browser"})
        return [e["message"] for e in entries if e.get("level") == "SEVERE"]

    def screenshot(self, path: str) -> None:
        with open(path, "wb") as handle:
            handle.write(base64.b64decode(self._call("GET", f"{self.session}/screenshot")))

    def close(self) -> None:
        self._call("DELETE", self.session)


@contextmanager
def browser(workdir: str):
    """chromedriver on a free port and one headless Chromium session; both stopped afterwards."""
    port = free_port()
    with open(os.path.join(workdir, "chromedriver.log"), "wb") as log:
        process = subprocess.Popen([CHROMEDRIVER, f"--port={port}"], stdout=log, stderr=subprocess.STDOUT)
    driver = f"http://127.0.0.1:{port}"
    session = None
    profile = os.path.join(workdir, "chrome-profile")
    try:
        _wait(
            lambda: json.loads(http_get(f"{driver}/status")[1])["value"]["ready"], 30, "chromedriver", process
        )
        session = Browser(driver, profile)
        yield session
    finally:
        if session is not None:
            try:
                session.close()
            except (OSError, RuntimeError):
                pass
        _stop(process)
        shutil.rmtree(profile, ignore_errors=True)
