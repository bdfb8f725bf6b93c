"""Shared test set-up: offline hub, CPU threads, and the markers' skip rules."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRITON_INTERPRET", "1")  # triton kernels run on CPU tensors (kernels/_triton.py)

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


def pytest_configure(config):
    pin_test_process()
    # `--dist loadfile` hands out whole files; xdist orders them by their number of tests
    # unless told not to, so one slow file of two tests could start last and run alone at
    # the end. The collection order below (slowest files first) is kept instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pin_test_process() -> None:
    """Under `pytest -n N`, each test process keeps cores of its own (gw0 the first of every
    N, gw1 the second, ...), so the engines' thread counts (engine.config.available_cores:
    the affinity mask) add up to the box's cores. Unpinned, two processes each start one
    OpenMP thread a core, and every parallel region's barrier waits on a thread the other
    process has descheduled (the whole suite on a 2-core Zen 1: 17 min 38 s unpinned, 13 min
    18 s pinned). DUPLEX_TEST_PIN=0 leaves the mask alone."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if (not worker or not count or os.environ.get("DUPLEX_TEST_PIN", "1") == "0"
            or not hasattr(os, "sched_setaffinity")):  # not Linux
        return
    cores = sorted(os.sched_getaffinity(0))
    index, count = int(worker.removeprefix("gw")), int(count)
    if count > 1 and len(cores) >= count:
        os.sched_setaffinity(0, cores[index % count::count])


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
    slowest_files_first(items)


def slowest_files_first(items) -> None:
    """Whole files, slowest first (FILE_SECONDS), each file's tests in their own order: two
    test processes then end within about one short file of each other."""
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::", 1)[0], len(first_seen))

    def key(item) -> tuple[float, int]:
        path = item.nodeid.split("::", 1)[0]
        return -FILE_SECONDS.get(path, 0.0), first_seen[path]
    items.sort(key=key)  # stable: a file's own order is kept


# About how many seconds a file takes in `make test` on the 2-core box (the --durations of a
# run with pinned test processes on an AVX2 Zen 1, setup included; files not listed take
# under 20 s). Only the order matters: a stale figure can cost time at the end of the run,
# never a result.
FILE_SECONDS: dict[str, float] = {
    "tests/engine/test_equivalence.py": 112,
    "tests/engine/test_fused_decode.py": 105,
    "tests/engine/test_triton_backend.py": 103,
    "tests/clients/test_doc_commands.py": 92,
    "tests/moe/test_expert_parallel.py": 84,
    "tests/moe/test_ep_serving.py": 71,
    "tests/bench/test_bench_baseline.py": 54,
    "tests/engine/test_quantized.py": 44,
    "tests/disagg/test_handoff_e2e.py": 41,
    "tests/test_install.py": 41,
    "tests/worker/test_engine_client.py": 40,
    "tests/web/test_web_ui.py": 39,
    "tests/clients/test_real_server.py": 25,
    "tests/frontend/test_e2e_overlap.py": 23,
    "tests/worker/test_supervisor.py": 22,
    "tests/frontend/test_e2e_serve.py": 22,
    "tests/structured/test_structured_api.py": 21,
    "tests/engine/test_cuda_graphs.py": 20,
}
