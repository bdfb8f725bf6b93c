"""duplex.bench.kv_fleet: the trace's hit-rate bound."""
from duplex.bench.kv_fleet import hash_bound


def test_bound_counts_leading_blocks_seen_before_and_never_new_ones():
    entries = [{"hash_ids": [0, 1, 2]},     # cold: 0 of 3
               {"hash_ids": [0, 1, 5, 6]},  # 0, 1 seen: 2 of 4
               {"hash_ids": [0, 9, 1]},     # only 0 leads: (0, 9) is new: 1 of 3
               {"hash_ids": [0, 1, 2, 7]}]  # 3 of 4; 7 is new
    assert hash_bound(entries, max_blocks=100) == (0 + 2 + 1 + 3) / 14
    assert hash_bound(entries, max_blocks=2) == (0 + 2 + 1 + 2) / 8  # prompts clipped
