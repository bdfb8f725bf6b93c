"""A real `redis-server` for tests: started on a free 127.0.0.1 port in a temp dir, with
no persistence; tests may kill it and start it again on the same port."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

BINARY = shutil.which("redis-server")
SKIP_REASON = "redis-server is not installed (make test installs it with apt where it can)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, workdir: Path, *extra: str) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.extra = extra
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        if BINARY is None:
            pytest.skip(SKIP_REASON)
        self.process = subprocess.Popen(
            [BINARY, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def command(self, *args: str) -> bytes:
        """One raw command (inline protocol) and its raw reply, for checks and config."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall((" ".join(args) + "\r\n").encode())
            time.sleep(0.05)
            return s.recv(1 << 16)
