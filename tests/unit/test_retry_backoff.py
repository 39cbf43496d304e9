"""Retry attempts and the pause before each retry (``[retry] enabled, backoff_multiplier,
jitter_factor``), computed on fixed draws."""

from __future__ import annotations

import pytest

from pd_router.config import ConfigError, load_config
from pd_router.dataplane.routing.retry import RetryConfig, attempts, backoff_secs


def test_pauses_grow_by_the_multiplier_until_the_cap():
    config = RetryConfig(backoff_base_secs=0.05, backoff_multiplier=1.5, backoff_max_secs=0.1)
    pauses = [backoff_secs(config, retry) for retry in (1, 2, 3)]
    assert pauses == pytest.approx([0.05, 0.075, 0.1])


def test_jitter_spreads_the_pause_by_its_fraction_both_ways():
    config = RetryConfig(backoff_base_secs=1.0, backoff_max_secs=1.0, jitter_factor=0.2)
    low, mid, high = (backoff_secs(config, 1, lambda d=d: d) for d in (0.0, 0.5, 1.0))
    assert (low, mid, high) == pytest.approx((0.8, 1.0, 1.2))


def test_jitter_applies_to_the_capped_pause():
    config = RetryConfig(backoff_base_secs=1.0, backoff_max_secs=2.0, jitter_factor=0.5)
    assert backoff_secs(config, 10, lambda: 0.0) == pytest.approx(1.0)


def test_disabled_retries_mean_one_attempt():
    assert attempts(RetryConfig(max_attempts=5, enabled=False)) == 1
    assert attempts(RetryConfig(max_attempts=5)) == 5


def test_retry_keys_are_read_from_the_config():
    retry = load_config(
        None, {"retry": {"enabled": False, "backoff_multiplier": 1.5, "jitter_factor": 0.2}}
    ).retry
    assert (retry.enabled, retry.backoff_multiplier, retry.jitter_factor) == (False, 1.5, 0.2)


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"retry": {"jitter_factor": 1.5}}, "retry.jitter_factor"),
        ({"retry": {"jitter_factor": -0.1}}, "retry.jitter_factor"),
        ({"retry": {"backoff_multiplier": 0}}, "retry.backoff_multiplier"),
        ({"retry": {"enabled": 1}}, "retry.enabled"),
    ],
)
def test_invalid_retry_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as caught:
        load_config(None, data)
    assert caught.value.key == key
