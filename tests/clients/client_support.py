"""Client-test support: a Duplex app over the fake engine on a real 127.0.0.1 port, run on
its own event loop thread so that blocking clients (subprocesses, SDKs) can call it; the real
`duplex serve` as a subprocess; a pseudo-terminal to drive `duplex chat` as a person would;
and a WebSocket exchange that makes the server send every kind of frame."""
from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "frontend"))  # frontend_fakes

from frontend_fakes import FakeEngineClient, FakeRecipe  # noqa: E402

from duplex.frontend.server import AppState, ServerOptions, build_app  # noqa: E402


class ServerThread:
    """The app on a daemon thread's loop. `stop` and `start` again keep the port, so a
    test can take the server away mid-answer and bring it back."""

    def __init__(self, engine: FakeEngineClient, **options) -> None:
        self.engine = engine
        self.options = ServerOptions(web_dir=None, **options)
        self.port = 0
        self._runner = None
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"

    def start(self) -> "ServerThread":
        self._call(self._start())
        return self

    def stop(self) -> None:
        if self._runner is not None:
            self._call(self._runner.cleanup())
            self._runner = None

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start(self) -> None:
        from aiohttp import web
        state = AppState(self.engine, FakeRecipe(), self.options)
        self._runner = web.AppRunner(build_app(state), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]


def client_env(**extra: str) -> dict[str, str]:
    """Environment of a client subprocess: the repo importable, no stray key or proxy."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DUPLEX_API_KEY", "DUPLEX_URL") and "proxy" not in k.lower()}
    return {**env, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **extra}


class Terminal:
    """A child process on a pseudo-terminal that is its controlling terminal, so typing
    Ctrl-C (\\x03) sends it SIGINT as a real terminal does. `expect` reads what it printed
    (escape sequences and carriage returns removed) past the previous match."""

    _ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|\r")

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path = REPO) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: become the program
            os.chdir(cwd)
            # as in a fresh terminal: a runner started in the background (`cmd &`, nohup)
            # ignores SIGINT, which exec would pass on, and Python then never sees Ctrl-C
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(argv[0], argv, env)
        self.pid, self.fd = pid, fd
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 250, 0, 0))
        self.text = ""
        self._pos = 0
        self.returncode: int | None = None

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def expect(self, pattern: str, timeout_s: float = 15.0) -> re.Match:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while not (match := regex.search(self.text, self._pos)):
            if not self._read(deadline - time.monotonic()):
                raise AssertionError(f"{pattern!r} not printed; got:\n{self.text[self._pos:]}")
        self._pos = match.end()
        return match

    def wait(self, timeout_s: float = 15.0) -> int:
        deadline = time.monotonic() + timeout_s
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif not self._read(min(0.1, deadline - time.monotonic())) \
                    and time.monotonic() > deadline:
                raise AssertionError(f"still running; printed:\n{self.text}")
        self._read(0.1)
        return self.returncode

    def close(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.returncode = -signal.SIGKILL
        os.close(self.fd)

    def _read(self, timeout_s: float) -> bool:
        """Read what is there (waiting up to timeout_s); False when nothing came."""
        if timeout_s <= 0 or not select.select([self.fd], [], [], timeout_s)[0]:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        self.text += self._ESCAPES.sub("", data.decode(errors="replace"))
        return bool(data)


class RealServer:
    """`duplex serve` with the default model as a subprocess on a free port."""

    def __init__(self, log_path: Path, *flags: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.process = subprocess.Popen(
            [sys.executable, "-m", "duplex.frontend.cli", "serve", "--port", str(self.port),
             "--num-kv-blocks", "256", "--max-model-len", "2048", "--log-level", "warning",
             "--num-threads", "1",  # beside the other test process (test_e2e_serve)
             *flags], cwd=REPO, env=client_env(), stdout=subprocess.DEVNULL,
            stderr=open(log_path, "w"), start_new_session=True)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log_path.read_text()[-3000:]
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"not healthy in {timeout_s} s\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def record_exchange(ws_url: str, timeout_s: float = 60.0) -> list[dict]:
    """Every frame the server sends in an exchange that provokes each frame type: a finished
    request, a cancelled one, a refused frame (id null), a frame with a bad field, a ping."""
    from websockets.sync.client import connect

    hi = [{"role": "user", "content": "Count from one to ten."}]
    frames: list[dict] = []
    with connect(ws_url) as ws:
        ws.send(json.dumps({"type": "chat", "id": "long", "messages": hi, "max_tokens": 300,
                            "ignore_eos": True}))
        ws.send(json.dumps({"type": "chat", "id": "short", "messages": hi, "max_tokens": 4,
                            "temperature": 0}))
        ws.send("not json")
        ws.send(json.dumps({"type": "chat", "id": "bad", "messages": hi, "max_tokens": "4"}))
        ws.send(json.dumps({"type": "ping"}))
        waiting = {"long", "short", "bad", None, "pong"}
        is_cancel_sent = False
        while waiting:
            frame = json.loads(ws.recv(timeout=timeout_s))
            frames.append(frame)
            if frame["type"] == "delta" and frame["id"] == "long" and not is_cancel_sent:
                ws.send(json.dumps({"type": "cancel", "id": "long"}))
                is_cancel_sent = True
            elif frame["type"] in ("done", "error"):
                waiting.discard(frame["id"])
            elif frame["type"] == "pong":
                waiting.discard("pong")
    return frames
