"""The trainer's own staleness check on a train batch's per-token weight versions."""

from __future__ import annotations

import numpy as np
import pytest

from meshrl.algorithms.batch import RLTrainBatch
from meshrl.trainer.rl_loop import StaleBatchError, check_versions


def _batch(versions_BxL: np.ndarray, mask_BxL: np.ndarray) -> RLTrainBatch:
    zeros_i, zeros_f = np.zeros(mask_BxL.shape, np.int32), np.zeros(mask_BxL.shape, np.float32)
    return RLTrainBatch(input_ids=zeros_i, targets=zeros_i, loss_mask=mask_BxL,
                        positions=zeros_i, segment_ids=zeros_i + 1, behaviour_logprobs=zeros_f,
                        advantages=zeros_f, versions=versions_BxL,
                        sample_ids=zeros_i + np.arange(mask_BxL.shape[0], dtype=np.int32)[:, None])


def test_batch_with_a_token_older_than_max_staleness_raises_naming_versions_and_limit():
    # Row 1 holds one loss token of version 2; the step updates version 5 with staleness 2.
    versions = np.array([[-1, 5, 4, -1], [-1, 2, 5, 5]], np.int32)
    mask = (versions >= 0).astype(np.float32)

    with pytest.raises(StaleBatchError, match=r"version 5 holds a token of version 2: lag 3 > "
                                              r"rollout.max_staleness = 2"):
        check_versions(_batch(versions, mask), version=5, max_staleness=2)


def test_version_lags_are_per_sample_over_loss_tokens_only_and_empty_without_any():
    # The version-0 token is off the loss mask (e.g. environment feedback): it does not count.
    versions = np.array([[0, 5, 4, -1], [-1, 5, 5, -1]], np.int32)
    mask = np.array([[0, 1, 1, 0], [0, 1, 1, 0]], np.float32)

    lags = check_versions(_batch(versions, mask), version=5, max_staleness=1)
    np.testing.assert_array_equal(lags, [1, 0])
    assert check_versions(_batch(versions, np.zeros_like(mask)), version=5,
                          max_staleness=0).size == 0
