"""Expert-parallel load balancing (EPLB) for mixture-of-experts layers.

`stats` counts tokens per expert over a sliding window, `placement` computes and evaluates
which expert each rank's slots hold (with redundant replicas of hot experts) and routes tokens
to replicas, `balancer` decides when to switch to a new placement.
"""
from duplex.engine.eplb.balancer import Balancer
from duplex.engine.eplb.placement import (Move, Placement, compute_placement, identity_placement,
                                   imbalance, moved_bytes, moves, rank_load, route)
from duplex.engine.eplb.stats import ExpertLoadStats

__all__ = ["Balancer", "ExpertLoadStats", "Move", "Placement", "compute_placement",
           "identity_placement", "imbalance", "moved_bytes", "moves", "rank_load", "route"]
