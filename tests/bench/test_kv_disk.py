"""The disk read benchmark runs end to end on a tiny data set."""
import pytest

from duplex.bench.kv_disk import measure_read_mb_s


@pytest.mark.parametrize("cold", [True, False])
def test_measure_read_mb_s_reports_both_figures(tmp_path, cold):
    result = measure_read_mb_s(str(tmp_path), 4096, 8, cold=cold)
    assert set(result) == {"tier_read_mb_s", "tier_serial_read_mb_s", "raw_read_mb_s",
                           "block_bytes", "num_blocks", "cold"}
    assert result["tier_read_mb_s"] > 0 and result["raw_read_mb_s"] > 0
    assert (result["block_bytes"], result["num_blocks"], result["cold"]) == (4096, 8, float(cold))
