"""Start and stop a ``specserve serve`` subprocess for ``bench --ab``."""

from __future__ import annotations

import collections
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO

import httpx

from specserve.errors import SpecserveError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_argv(serve_args: str, port: int) -> list[str]:
    """Command line of ``python -m specserve serve <args> --port <port>``."""
    return [sys.executable, "-m", "specserve", "serve", *shlex.split(serve_args),
            "--host", "127.0.0.1", "--port", str(port)]


class ManagedServer:
    """A server subprocess: started, waited for on /health, stopped with SIGINT then kill."""

    def __init__(self, argv: list[str], port: int, label: str, startup_timeout: float = 600.0,
                 stop_timeout: float = 20.0):
        self.argv, self.port, self.label = argv, port, label
        self.url = f"http://127.0.0.1:{port}"
        self.startup_timeout, self.stop_timeout = startup_timeout, stop_timeout
        self.proc: subprocess.Popen[str] | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._reader: threading.Thread | None = None

    def last_lines(self, n: int = 15) -> str:
        """The server's last output lines (stdout and stderr together)."""
        return "\n".join(list(self.tail)[-n:])

    def _drain(self, stream: IO[str]) -> None:
        for line in stream:
            self.tail.append(line.rstrip("\n"))

    def start(self) -> "ManagedServer":
        """Launch and block until GET /health answers 200; SpecserveError if it dies or hangs."""
        try:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, text=True, bufsize=1)
        except OSError as exc:
            raise SpecserveError(f"cannot start server {self.label}: {exc}") from exc
        assert self.proc.stdout is not None
        self._reader = threading.Thread(target=self._drain, args=(self.proc.stdout,), daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._reader.join(timeout=2)
                raise SpecserveError(f"server {self.label} exited with status {self.proc.returncode} "
                                     f"before it was healthy; last output:\n{self.last_lines()}")
            if self._healthy():
                return self
            time.sleep(0.25)
        self.stop()
        raise SpecserveError(f"server {self.label} not healthy after {self.startup_timeout:g} s; "
                             f"last output:\n{self.last_lines()}")

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> int | None:
        """SIGINT, then kill after ``stop_timeout``; returns the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self._reader:
            self._reader.join(timeout=2)
        return self.proc.returncode

    def __enter__(self) -> "ManagedServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
