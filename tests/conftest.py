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
    # `--dist loadfile` hands out whole files; xdist orders them by their number of tests
    # unless told not to, so one slow file of two tests could start last and run alone at
    # the end. The collection order below (slowest files first) is kept instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


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


# About how many seconds a file takes in `make test` on the 2-core box (from the --durations
# of recent runs, setup included; files not listed take well under 20 s). Only the order
# matters: a stale figure can cost time at the end of the run, never a result.
FILE_SECONDS: dict[str, float] = {
    "tests/engine/test_equivalence.py": 180,
    "tests/moe/test_expert_parallel.py": 150,
    "tests/engine/test_triton_backend.py": 150,
    "tests/clients/test_doc_commands.py": 110,
    "tests/bench/test_bench_baseline.py": 75,
    "tests/test_install.py": 60,
    "tests/moe/test_ep_serving.py": 60,
    "tests/engine/test_quantized.py": 55,
    "tests/clients/test_real_server.py": 55,
    "tests/web/test_web_real_model.py": 45,
    "tests/frontend/test_e2e_overlap.py": 45,
    "tests/disagg/test_handoff_e2e.py": 45,
    "tests/models_gguf/test_startup_failures.py": 40,
    "tests/engine/test_cuda_graphs.py": 40,
    "tests/frontend/test_e2e_serve.py": 40,
    "tests/batch_invariant/test_batch_invariant_engine.py": 40,
    "tests/models_gguf/test_gguf_archs.py": 40,
    "tests/engine/test_overlap.py": 35,
    "tests/spec/test_spec_engine.py": 35,
    "tests/frontend/test_serve_shared_kv.py": 30,
    "tests/structured/test_structured_api.py": 30,
    "tests/bench/test_bench_serve.py": 30,
    "tests/bench/test_bench_faults.py": 30,
    "tests/models_gguf/test_gguf_deepseek2_tokenizer.py": 25,
    "tests/bench/test_shapes.py": 25,
    "tests/worker/test_real_core.py": 21,
}
