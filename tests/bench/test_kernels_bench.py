"""duplex.bench.kernels runs end to end on a GPU and reports every kernel."""
import pytest


@pytest.mark.gpu
def test_bench_all_reports_every_kernel():
    from duplex.bench.kernels import bench_all
    results = bench_all()
    assert set(results) >= {"store_kv", "rms_norm_residual", "rotary", "linear_batch_invariant",
                            "paged_attention_decode", "paged_attention_prefill"}
    assert all(r["triton_ms"] > 0 and r["torch_ms"] > 0 for r in results.values())
