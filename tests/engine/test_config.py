"""EngineConfig: nested frozen sections built from flat names, JSON round trips, and every
combination that cannot work refused at construction with a one-line reason."""
from types import SimpleNamespace

import msgspec
import pytest

from duplex.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig, WorkerConfig
from duplex.engine.core import uses_hybrid_kv
from duplex.engine.worker import check_role, role_config


def test_flat_names_land_in_their_sections():
    config = EngineConfig.of(max_num_seqs=4, num_kv_blocks=64, speculation="ngram",
                             expert_parallel=1, seed=7)
    assert config.scheduler == SchedulerConfig(max_num_seqs=4)
    assert config.cache == CacheConfig(num_kv_blocks=64)
    assert config.spec == SpecConfig(speculation="ngram")
    assert config.seed == 7 and config.get("num_kv_blocks") == 64
    assert config.replace(block_size=32).cache.block_size == 32
    assert config.replace(block_size=32).cache.num_kv_blocks == 64
    assert EngineConfig.of(role="decode", heartbeat_s=0.2).worker == WorkerConfig(
        role="decode", heartbeat_s=0.2)


def test_unknown_or_section_names_are_refused():
    for name in ("no_such_field", "cache"):
        with pytest.raises(TypeError, match=f"no field '{name}'"):
            EngineConfig.of(**{name: 1})


def test_json_round_trip_keeps_every_section():
    config = EngineConfig.of(num_kv_blocks=64, kv_host_bytes=1 << 20, spec_token_cost=0.1,
                             speculation="self", eplb_interval_steps=9, max_model_len=512,
                             role="prefill", handoff_lease_s=3.0)
    assert msgspec.json.decode(msgspec.json.encode(config), type=EngineConfig) == config


def test_a_section_validates_its_fields_even_from_json():
    with pytest.raises(msgspec.ValidationError, match="block_size must be one of"):
        msgspec.json.decode(b'{"cache": {"block_size": 7}}', type=EngineConfig)


@pytest.mark.parametrize("field,value", [("kv_dir", "/tmp/kv"), ("kv_host_bytes", 1 << 20),
                                         ("kv_remote", "redis://localhost:6379/0")])
def test_a_kv_tier_without_prefix_caching_is_refused(field, value):
    with pytest.raises(ValueError, match=f"{field} needs enable_prefix_caching"):
        EngineConfig.of(enable_prefix_caching=False, **{field: value})


def test_hybrid_kv_with_speculation_is_refused_on_a_sliding_window_model():
    swa = SimpleNamespace(layer_windows=(None, 128))
    with pytest.raises(ValueError, match="--hybrid-kv cannot run with --speculation ngram"):
        uses_hybrid_kv(EngineConfig.of(speculation="ngram"), swa)
    assert uses_hybrid_kv(EngineConfig.of(), swa)
    assert not uses_hybrid_kv(EngineConfig.of(speculation="ngram", hybrid_kv=False), swa)
    dense = SimpleNamespace(layer_windows=(None, None))  # no SWA layers: nothing to refuse
    assert not uses_hybrid_kv(EngineConfig.of(speculation="ngram"), dense)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_split_role_with_hybrid_kv_is_refused(role):
    core = SimpleNamespace(runner=object(), layout=object())
    with pytest.raises(ValueError, match=f"a {role} worker cannot hand over hybrid"):
        check_role(core, role)
    check_role(core, "unified")
    check_role(SimpleNamespace(runner=object(), layout=None), role)


@pytest.mark.parametrize("field,value,reason", [
    ("role", "router", "role must be unified, prefill or decode"),
    ("heartbeat_s", 0.0, "heartbeat_s must be > 0"),
    ("handoff_lease_s", -1.0, "handoff_lease_s must be > 0"),
    ("kv_bind", "127.0.0.1:5600", "kv_bind must be tcp://HOST:PORT"),
    ("kv_bind", "tcp://127.0.0.1", "kv_bind must be tcp://HOST:PORT"),
])
def test_the_worker_section_refuses_a_bad_field(field, value, reason):
    with pytest.raises(ValueError, match=reason):
        EngineConfig.of(**{field: value})


def test_the_worker_section_takes_a_door_on_any_port_or_an_ipc_path():
    assert EngineConfig.of(kv_bind="tcp://10.0.0.6:*").worker.kv_bind == "tcp://10.0.0.6:*"
    assert WorkerConfig(kv_bind="ipc:///tmp/kv.ipc").kv_bind == "ipc:///tmp/kv.ipc"


def test_a_split_role_with_expert_parallel_is_refused():
    with pytest.raises(ValueError, match="role must be unified with expert_parallel > 1"):
        EngineConfig.of(expert_parallel=2, role="decode")
    assert EngineConfig.of(expert_parallel=2).worker.role == "unified"


def test_a_decode_role_gets_a_host_tier_for_the_kv_it_receives():
    config = EngineConfig.of(role="decode", kv_cache_bytes=1 << 24)
    assert role_config(config).cache.kv_host_bytes == 1 << 24
    assert role_config(config.replace(role="prefill")).cache.kv_host_bytes == 0
