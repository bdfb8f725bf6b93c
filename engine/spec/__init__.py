"""Speculative decoding: drafters propose tokens, the target verifies them in the same
flattened batch as everything else, and the output distribution never changes.

    ngram.py        prompt-lookup drafter (the request's own context)
    draft_model.py  model drafters: a separate draft model, or the target's first layers
    verify.py       greedy verification and exact rejection sampling
    confidence.py   online acceptance predictor, calibration, load-aware stopping rule
    speculator.py   the engine-facing object: propose, clip, logit rows, verify, stats;
                    it measures what verifying n tokens costs into the engine's CostModel
"""
from duplex.engine.spec.speculator import Speculator

__all__ = ["Speculator"]
