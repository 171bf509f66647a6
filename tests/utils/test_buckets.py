"""The one bucket lookup shared by the sampler and the rollout batch builder."""

from __future__ import annotations

import pytest

from meshrl.utils.buckets import bucket_for


@pytest.mark.parametrize(("n", "want"), [(0, 4), (1, 4), (4, 4), (5, 8), (8, 8), (9, 16)])
def test_bucket_for_picks_the_smallest_bucket_holding_n_whatever_the_order(n, want):
    assert bucket_for(n, (4, 8, 16)) == want
    assert bucket_for(n, [16, 4, 8]) == want


def test_bucket_for_past_the_largest_bucket_names_what_the_value_and_the_fix():
    with pytest.raises(ValueError) as info:
        bucket_for(17, (16, 4), what="trajectory length", fix="raise the bucket")

    assert str(info.value) == ("trajectory length 17 exceeds the largest bucket 16; "
                               "raise the bucket")


def test_bucket_for_without_buckets_is_an_error_not_a_crash():
    with pytest.raises(ValueError, match="length 1 exceeds the largest bucket 0"):
        bucket_for(1, ())
