"""Shared test set-up: offline hub, CPU threads, and the markers' skip rules."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.redis_server import RedisServer  # noqa: E402


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real redis-server for the session (skips with a reason where it is missing).
    Tests that kill or reconfigure a server start their own with `redis_factory`."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture
def redis_factory(tmp_path):
    """Private redis-servers (extra args: e.g. "--maxmemory", "2mb"), started unless
    started=False (a port where nothing listens yet)."""
    servers: list[RedisServer] = []

    def start(*extra: str, started: bool = True) -> RedisServer:
        servers.append(RedisServer(tmp_path, *extra))
        return servers[-1].start() if started else servers[-1]
    yield start
    for server in servers:
        server.kill()


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
