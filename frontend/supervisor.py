"""Supervisor: the engine worker processes of one server; starts them, restarts the dead ones
with backoff, forwards signals, and never leaves one behind.

Owns the worker processes, the one frontend address they all connect to (an ipc:// socket in a
private temp dir by default, or tcp://127.0.0.1 with a free port), and each worker's share of
the CPU threads (torch threads split evenly unless --num-threads is set). No orphans, by three
layers:
* `close()` (also on `async with` exit, exceptions included): SIGTERM, grace, then SIGKILL;
* an atexit hook SIGKILLs whatever is still running if the loop never got to `close()`;
* each worker asks Linux for SIGKILL when its parent dies (`--parent-pid` -> PR_SET_PDEATHSIG),
  which covers a SIGKILLed server. Each worker leads its own process group, killed as a whole.

Each worker gets the server's one EngineConfig as JSON (frontend/serve_config.py: every
setting, the served-worker policy and the kernels.switches values included), serialized once;
its flags only say which worker it is (role, address, id, parent).

Only workers that die while serving are restarted. A worker that could not start (bad config,
a model it cannot load; see engine/worker_cli.py) writes its one-line reason to the start-up
error file the supervisor names and exits: it never came up and never would, so its slot stops
("failed"), the reason is kept in `startup_failure`, and the `on_startup_failure` callbacks
run (`duplex serve` then exits non-zero with that line instead of answering 503 forever).
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple


import msgspec

from duplex.engine.config import EngineConfig, available_cores

if TYPE_CHECKING:
    from duplex.frontend.engine_client import EngineClient

log = logging.getLogger(__name__)

# A worker that ran this long before dying restarts after the shortest backoff again.
STABLE_AFTER_S = 30.0

OnWorkerExit = Callable[[int, str], None]  # (pid, reason)
OnStartupFailure = Callable[[str], None]  # (reason)


class WorkerStatus(NamedTuple):
    worker_id: str
    role: str
    address: str
    pid: int  # 0 while no process runs
    state: str  # "starting" | "running" | "backoff" | "stopped" | "failed"
    num_restarts: int
    last_exit: str  # how the previous process ended, "" if none did


class _Slot:
    """One worker position: the process currently filling it and its restart history."""

    def __init__(self, worker_id: str, role: str, address: str, backoff_s: float) -> None:
        self.worker_id, self.role, self.address = worker_id, role, address
        self.process: asyncio.subprocess.Process | None = None
        self.state = "starting"
        self.num_restarts = 0
        self.last_exit = ""
        self.started_at = 0.0
        self.backoff_s = backoff_s
        self.error_file = ""  # set by the supervisor: a worker that cannot start says why there

    @property
    def is_alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def signal(self, signum: int) -> None:
        if self.is_alive:
            try:
                os.killpg(self.process.pid, signum)
            except ProcessLookupError:
                pass

    def status(self) -> WorkerStatus:
        pid = self.process.pid if self.is_alive else 0
        return WorkerStatus(self.worker_id, self.role, self.address, pid, self.state,
                            self.num_restarts, self.last_exit)


class Supervisor:
    def __init__(self, config: EngineConfig, *, roles: Sequence[str] = ("unified",),
                 use_tcp: bool = False, restart_backoff_s: tuple[float, float] = (0.5, 10.0),
                 worker_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 address: str | None = None) -> None:
        self.config = config
        self._min_backoff_s, self._max_backoff_s = restart_backoff_s
        # extra `duplex worker` flags for tests (--core, --heartbeat-s); `duplex serve` passes
        # none: every setting rides in the config
        self._worker_args = list(worker_args)
        self._env = {**os.environ, **(env or {})}
        self._dir = tempfile.mkdtemp(prefix="duplex-")
        self.address = address or self._address(use_tcp)  # where the frontend binds
        self._slots = [_Slot(f"{role}-{i}", role, self.address, self._min_backoff_s)
                       for i, role in enumerate(roles)]
        for slot in self._slots:  # where a worker that cannot start writes why
            slot.error_file = os.path.join(self._dir, f"{slot.worker_id}.startup-error")
        # serialized once: every worker gets the same JSON, its flags say only which one it is
        self._config_json = msgspec.json.encode(worker_config(config, len(self._slots))).decode()
        self._exit_listeners: list[OnWorkerExit] = []
        self._startup_listeners: list[OnStartupFailure] = []
        self.startup_failure = ""  # why a worker could not start ("" while none failed so)
        self._tasks: list[asyncio.Task] = []
        self._closing = asyncio.Event()

    # ------------------------------------------------------------------ public API
    @property
    def addresses(self) -> list[str]:
        """The frontend address of each worker (all the same: one ROUTER serves them all)."""
        return [slot.address for slot in self._slots]

    @property
    def is_healthy(self) -> bool:
        return all(slot.state == "running" for slot in self._slots)

    def status(self) -> list[WorkerStatus]:
        return [slot.status() for slot in self._slots]

    def attach(self, client: EngineClient) -> None:
        """Wire a client to its worker: a worker the client finds dead (WorkerError, silence)
        is killed and restarted; a process exit is reported to the client."""
        client.on_worker_dead = lambda ready, reason: self.kill_worker(ready.worker_id,
                                                                       pid=ready.pid)
        self._exit_listeners.append(client.worker_exited)

    def on_startup_failure(self, listener: OnStartupFailure) -> None:
        """Call `listener(reason)` when a worker exits before it could ever serve."""
        self._startup_listeners.append(listener)

    async def start(self) -> None:
        atexit.register(self._kill_all_now)
        self._tasks = [asyncio.create_task(self._keep_alive(slot)) for slot in self._slots]

    def kill_worker(self, worker_id: str, *, pid: int | None = None) -> None:
        """SIGKILL a worker (it is then restarted); with `pid`, only if that process is still
        the one running, so a late report cannot kill its replacement."""
        for slot in self._slots:
            if slot.worker_id == worker_id and (pid is None or slot.status().pid == pid):
                slot.signal(signal.SIGKILL)

    def forward_signal(self, signum: int) -> None:
        for slot in self._slots:
            slot.signal(signum)

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop every worker: SIGTERM (they abort their requests and exit), then SIGKILL."""
        self._closing.set()
        await asyncio.gather(*(self._stop(slot, grace_s) for slot in self._slots))
        await asyncio.gather(*self._tasks, return_exceptions=True)
        atexit.unregister(self._kill_all_now)
        shutil.rmtree(self._dir, ignore_errors=True)

    async def __aenter__(self) -> Supervisor:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ process lifecycle
    async def _keep_alive(self, slot: _Slot) -> None:
        while not self._closing.is_set():
            try:
                await self._spawn(slot)
            except OSError as e:
                slot.last_exit = f"could not start: {e}"
                log.error("worker %s %s", slot.worker_id, slot.last_exit)
            else:
                returncode = await slot.process.wait()
                if self._closing.is_set():
                    break
                if self._report_exit(slot, returncode) == "failed":
                    return  # it never came up and would not on a restart
            await self._back_off(slot)

    async def _spawn(self, slot: _Slot) -> None:
        slot.state = "starting"
        slot.process = await asyncio.create_subprocess_exec(
            *self._command(slot), env=self._env, start_new_session=True)
        slot.started_at = time.monotonic()
        slot.state = "running"
        log.info("started worker %s (pid %d) at %s", slot.worker_id, slot.process.pid,
                 slot.address)
        if self._closing.is_set():  # close() ran while we were spawning
            slot.signal(signal.SIGKILL)

    def _command(self, slot: _Slot) -> list[str]:
        """The config, and which worker this process is (role, address, id, parent)."""
        return [sys.executable, "-m", "duplex.engine.worker_cli", "--role", slot.role,
                "--connect", slot.address, "--worker-id", slot.worker_id,
                "--config-json", self._config_json, "--parent-pid", str(os.getpid()),
                "--startup-error-file", slot.error_file, *self._worker_args]

    def _report_exit(self, slot: _Slot, returncode: int) -> str:
        """Tell the exit listeners; a worker that left a start-up error (it could not start)
        also fails its slot and tells the start-up listeners. Returns the slot's state."""
        slot.last_exit = _describe_exit(returncode)
        log.error("worker %s (pid %d) %s", slot.worker_id, slot.process.pid, slot.last_exit)
        for listener in self._exit_listeners:
            listener(slot.process.pid, slot.last_exit)
        reason = _read_reason(slot.error_file)
        if reason:
            slot.state = "failed"
            self.startup_failure = self.startup_failure or f"worker {slot.worker_id}: {reason}"
            for startup_listener in self._startup_listeners:
                startup_listener(self.startup_failure)
        return slot.state

    async def _back_off(self, slot: _Slot) -> None:
        if time.monotonic() - slot.started_at > STABLE_AFTER_S:
            slot.backoff_s = self._min_backoff_s
        slot.state = "backoff"
        try:  # wakes early when close() starts
            await asyncio.wait_for(self._closing.wait(), slot.backoff_s)
        except asyncio.TimeoutError:
            pass
        slot.backoff_s = min(slot.backoff_s * 2, self._max_backoff_s)
        slot.num_restarts += 1

    async def _stop(self, slot: _Slot, grace_s: float) -> None:
        if slot.state == "failed":
            return
        if slot.is_alive:
            slot.signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(slot.process.wait(), grace_s)
            except asyncio.TimeoutError:
                slot.signal(signal.SIGKILL)
                await slot.process.wait()
            slot.last_exit = _describe_exit(slot.process.returncode)
        slot.state = "stopped"

    def _kill_all_now(self) -> None:
        """atexit: no loop left to wait on, so SIGKILL without asking."""
        self.forward_signal(signal.SIGKILL)

    # ------------------------------------------------------------------ addresses
    def _address(self, use_tcp: bool) -> str:
        if use_tcp:
            return f"tcp://127.0.0.1:{_free_port()}"
        return f"ipc://{self._dir}/frontend.ipc"


def worker_config(config: EngineConfig, num_workers: int) -> EngineConfig:
    """Each worker's config: with --num-threads 0 the cores are split evenly between the
    workers (at least one thread each), so N workers do not oversubscribe the machine."""
    if config.num_threads or num_workers <= 1:
        return config
    return config.replace(num_threads=max(1, available_cores() // num_workers))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_reason(path: str) -> str:
    """The one line a worker left in its start-up error file ("" if none)."""
    try:
        with open(path) as f:
            return " ".join(f.read().split())
    except OSError:
        return ""


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"
