"""Retention classes and expiry."""
import pytest

from duplex.kvstore import retention
from duplex.kvstore.retention import AGENT, CHAT, RetentionPolicy, classify, expiry


def test_default_ttls():
    assert retention.CHAT_TTL_S == 7 * 86_400
    assert retention.AGENT_TTL_S == 3 * 86_400
    assert expiry(CHAT, 100.0) == 100.0 + 7 * 86_400
    assert expiry(AGENT, 100.0) == 100.0 + 3 * 86_400


@pytest.mark.parametrize("explicit, has_tools, expected", [
    (None, False, CHAT), (None, True, AGENT), ("chat", True, CHAT), ("agent", False, AGENT)])
def test_classify(explicit, has_tools, expected):
    assert classify(explicit, has_tools) == expected


@pytest.mark.parametrize("bad", ["", "Chat", "batch"])
def test_classify_rejects_unknown_classes(bad):
    with pytest.raises(ValueError):
        classify(bad, False)


def test_policy_is_configurable_frozen_and_validated():
    policy = RetentionPolicy(chat_ttl_s=10.0, agent_ttl_s=5.0)
    assert expiry(CHAT, 1.0, policy) == 11.0 and expiry(AGENT, 1.0, policy) == 6.0
    with pytest.raises(AttributeError):
        policy.chat_ttl_s = 1.0
    with pytest.raises(ValueError):
        RetentionPolicy(chat_ttl_s=0.0)
    with pytest.raises(ValueError):
        expiry("batch", 0.0)
