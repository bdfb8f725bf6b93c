"""WorkerLink: a worker's side of its channel to the frontend (engine/zmq_io.py).

It sends (Outputs, Ready, Heartbeat, WorkerError) and runs the channel's three background
loops: Ready on every (re)connection, the receiver feeding the worker's inbox, and
heartbeats with a Ready now and then. What goes in a Ready or a heartbeat is the worker's
to say (callbacks); the link only knows when to send it.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import Callable

import msgspec

from duplex.engine.messages import Heartbeat, Ready, WorkerError, WorkerStats
from duplex.engine.zmq_io import Channel

log = logging.getLogger("duplex.engine.worker")

_REANNOUNCE_EVERY = 4  # heartbeats between repeated Ready messages


class WorkerLink:
    def __init__(self, channel: Channel, worker_id: str, heartbeat_s: float) -> None:
        self.channel = channel
        self.worker_id = worker_id
        self.heartbeat_s = heartbeat_s

    @property
    def num_rejected(self) -> int:
        """Frames from the frontend that failed to decode (and were dropped)."""
        return self.channel.receiver.num_rejected

    async def send(self, msg: msgspec.Struct) -> None:
        await self.channel.sender.put(msg)

    async def send_error(self, message: str) -> None:
        """WorkerError, best effort: the socket may be the thing that broke."""
        try:
            await asyncio.wait_for(self.send(WorkerError(self.worker_id, message)), 1.0)
        except Exception:  # noqa: BLE001 - the socket may be the thing that broke
            log.exception("worker %s: could not send WorkerError", self.worker_id)

    # ------------------------------------------------------------------ background loops
    async def announce_forever(self, ready: Callable[[], Ready]) -> None:
        """Send Ready on every (re)connection: the frontend may be a new process that has
        never heard of us. The first one follows model load and warm-up."""
        async for _ in self.channel.handshakes():
            await self.send(ready())

    async def receive_forever(self, post: Callable[[msgspec.Struct], None]) -> None:
        while True:
            received = await self.channel.receiver.get()
            post(received.msg)

    async def heartbeat_forever(self, stats: Callable[[], WorkerStats],
                                ready: Callable[[], Ready]) -> None:
        """Heartbeats, and Ready again every few of them: a frontend that refused our Ready
        while a predecessor with our id still looked alive accepts it once that one is gone."""
        pid = os.getpid()
        for num_sent in itertools.count(1):
            await self.send(Heartbeat(self.worker_id, stats(), time.time(), pid))
            if num_sent % _REANNOUNCE_EVERY == 0:
                await self.send(ready())
            await asyncio.sleep(self.heartbeat_s)

    def close(self) -> None:
        self.channel.close(linger_ms=1000)  # let the last Outputs / WorkerError leave
