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
    """A free port whose cluster bus port (+10000) is a free port too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 < 65536 and _is_free(port + 10000):
            return port


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


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


class RedisCluster:
    """Three masters (no replicas) on free ports, slots split by `redis-cli --cluster create`."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = []
        for i in range(3):
            node_dir = workdir / f"node{i}"
            node_dir.mkdir()
            self.nodes.append(RedisServer(node_dir, "--cluster-enabled", "yes",
                                          "--cluster-config-file", "nodes.conf"))

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisCluster:
        cli = shutil.which("redis-cli")
        if cli is None:
            pytest.skip("redis-cli is not installed")
        for node in self.nodes:
            node.start()
        subprocess.run([cli, "--cluster", "create",
                        *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=30)
        deadline = time.monotonic() + 10
        while not all(b"cluster_state:ok" in n.command("CLUSTER", "INFO") for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("redis cluster did not come up")
            time.sleep(0.1)
        return self

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()
