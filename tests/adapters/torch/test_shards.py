"""Merging sharded statistics: pieces with element counts give the whole tensor's numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adapters.torch.sharded.shards import merge_pieces
from adapters.torch.stats import stat_matrix
from tests.adapters.torch.helpers import ALL_OPS, assert_stats_close


@pytest.mark.parametrize("with_nan", [False, True])
def test_merged_pieces_equal_statistics_of_the_whole(with_nan):
    rng = np.random.default_rng(0)
    whole = [rng.normal(size=n).astype(np.float32) for n in (17, 40, 5)]
    if with_nan:
        whole[1][3] = np.nan
    cuts = [(0, 6, 17), (0, 0, 25, 40), (0, 5, 5)]  # the second row has an empty piece on rank 0
    ranks = max(len(c) - 1 for c in cuts)
    values = np.full((ranks, len(whole), len(ALL_OPS)), np.nan)
    counts = np.zeros((ranks, len(whole)))
    for row, (array, cut) in enumerate(zip(whole, cuts)):
        for rank in range(len(cut) - 1):
            piece = array[cut[rank] : cut[rank + 1]]
            if piece.size:
                values[rank, row] = stat_matrix([torch.from_numpy(piece.copy())], ALL_OPS)[0].numpy()
                counts[rank, row] = piece.size
    merged = merge_pieces(values, counts, ALL_OPS)
    for row, array in enumerate(whole):
        assert_stats_close(dict(zip(ALL_OPS, merged[row])), array, what=f"row {row}")
