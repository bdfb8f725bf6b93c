"""duplex.frontend.supervisor: restarts with backoff, reports status, and leaves no orphan process
however the server ends (close, exception, plain exit, SIGKILL)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from duplex.engine.config import EngineConfig
from duplex.frontend.supervisor import Supervisor

from .conftest import FAKE_CORE, REPO, fake_worker_env, is_running, until

# A server process in miniature: a supervisor, a client, one worker; prints the worker's pid
# once it is ready, then ends the way argv[1] says.
SERVER_SCRIPT = f"""
import asyncio, sys
from duplex.engine.config import EngineConfig
from duplex.frontend.engine_client import EngineClient
from duplex.frontend.supervisor import Supervisor

async def main(how):
    supervisor = Supervisor(EngineConfig(), worker_args=["--core", "{FAKE_CORE}"])
    client = EngineClient(supervisor.addresses[0])
    await client.start()
    await supervisor.start()
    print((await client.wait_ready(30)).pid, flush=True)
    if how == "raise":
        async with supervisor:
            raise RuntimeError("server crashed")
    if how == "wait":
        await asyncio.sleep(60)
    # "return": leave without closing anything; atexit must clean up

asyncio.run(main(sys.argv[1]))
"""


def fake_supervisor(**kwargs) -> Supervisor:
    return Supervisor(EngineConfig(), worker_args=["--core", FAKE_CORE], env=fake_worker_env(),
                      **kwargs)


async def test_close_stops_the_worker_gracefully_and_reports_status(start_engine):
    engine = await start_engine()
    pid = engine.pid
    [status] = engine.supervisor.status()
    assert (status.worker_id, status.role, status.pid, status.state) == (
        "unified-0", "unified", pid, "running")
    assert status.address.startswith("ipc://") and engine.supervisor.is_healthy

    await engine.supervisor.close()
    [status] = engine.supervisor.status()
    assert (status.pid, status.state, status.last_exit) == (0, "stopped", "exited with code 0")
    assert not is_running(pid) and not engine.supervisor.is_healthy


async def test_exception_inside_the_server_kills_the_worker():
    pid = 0
    with pytest.raises(RuntimeError, match="server crashed"):
        async with fake_supervisor(use_tcp=True) as supervisor:
            assert supervisor.addresses[0].startswith("tcp://127.0.0.1:")
            await until(lambda: supervisor.status()[0].pid != 0)
            pid = supervisor.status()[0].pid
            raise RuntimeError("server crashed")
    assert pid and not is_running(pid)


@pytest.mark.parametrize("how", ["raise", "return", "sigkill"])
async def test_no_orphan_worker_however_the_server_process_ends(how):
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SERVER_SCRIPT, "wait" if how == "sigkill" else how,
        env={**os.environ, **fake_worker_env()}, cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL)
    worker_pid = int(await asyncio.wait_for(server.stdout.readline(), 30))
    if how == "sigkill":  # no cleanup code runs: the kernel's PDEATHSIG must do it
        server.kill()
    await asyncio.wait_for(server.wait(), 10)
    await until(lambda: not is_running(worker_pid), timeout_s=5)


async def test_a_worker_that_dies_while_running_is_restarted_with_growing_backoff():
    supervisor = fake_supervisor(restart_backoff_s=(0.05, 0.2))
    await supervisor.start()
    try:
        for num_restarts in range(3):
            await until(lambda: supervisor.status()[0].pid != 0, timeout_s=60)
            os.killpg(supervisor.status()[0].pid, signal.SIGKILL)
            await until(lambda: supervisor.status()[0].num_restarts == num_restarts + 1,
                        timeout_s=60)
        [status] = supervisor.status()
        assert status.last_exit == "killed by SIGKILL" and supervisor.startup_failure == ""
        assert supervisor._slots[0].backoff_s == 0.2  # doubled up to the cap
    finally:
        await supervisor.close()


async def test_a_worker_that_cannot_start_is_not_restarted_and_says_why():
    env = {**fake_worker_env(), "DUPLEX_FAKE_CORE": "not json"}  # the core cannot start
    supervisor = Supervisor(EngineConfig(), worker_args=["--core", FAKE_CORE], env=env,
                            restart_backoff_s=(0.05, 0.2))
    reasons = []
    supervisor.on_startup_failure(reasons.append)
    await supervisor.start()
    try:
        await until(lambda: supervisor.status()[0].state == "failed", timeout_s=60)
        await asyncio.sleep(0.5)  # several backoffs: nothing restarts it
        [status] = supervisor.status()
        assert (status.num_restarts, status.pid, status.last_exit) == (0, 0, "exited with code 3")
        assert reasons == [supervisor.startup_failure] == [
            "worker unified-0: the engine core failed to start (its traceback is in the "
            "worker's log above)"]
        assert not supervisor.is_healthy
    finally:
        await supervisor.close()


async def test_forward_signal_reaches_the_worker(start_engine):
    engine = await start_engine()
    old_pid = engine.pid
    engine.supervisor.forward_signal(signal.SIGTERM)  # the worker shuts down cleanly ...
    await until(lambda: engine.supervisor.status()[0].num_restarts == 1)
    assert engine.supervisor.status()[0].last_exit == "exited with code 0"
    await engine.client.wait_ready(30)  # ... and, not being closed, is started again
    assert engine.pid != old_pid
