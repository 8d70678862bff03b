"""Randomized fault trials (tests/fault_trials.py): a short run always, 500 with INFINI_DIST_SLOW=1."""

import os

import pytest

import fault_trials


def _assert_clean(result, world_sizes):
    for world_size in world_sizes:
        counts = result[world_size]
        assert counts["hangs"] == 0 and counts["divergent"] == 0, counts
        assert counts["wrong"] == 0 and counts["cache_invalid"] == 0, counts
        assert counts["divergences_caught"] == counts["divergences"], counts


def test_a_few_random_fault_trials():
    result = fault_trials.run(12, seed=1, world_sizes=(3,))
    _assert_clean(result, (3,))
    assert result[3]["trials"] == 12 and result[3]["faults"] > 0
    assert result[3]["divergences"] > 0


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("INFINI_DIST_SLOW") != "1", reason="set INFINI_DIST_SLOW=1")
def test_500_random_fault_trials():
    result = fault_trials.run(int(os.environ.get("INFINI_DIST_TRIALS", "500")))
    _assert_clean(result, (2, 3, 4))
