"""ZeRO chunks as DCP boxes (autopar.runtime.checkpoint.flat_boxes): every flat range of a
row-major tensor is tiled exactly, in order, by at most 2 * ndim - 1 contiguous boxes."""

import itertools
import math

import pytest
import torch

from autopar.runtime.checkpoint import flat_boxes


@pytest.mark.parametrize("shape", [(7,), (5, 3), (4, 1, 6), (3, 4, 5), (2, 3, 2, 3), (1, 9)])
def test_boxes_tile_every_range_in_order(shape):
    numel = math.prod(shape)
    whole = torch.arange(numel).view(shape)
    for start, stop in itertools.combinations(range(numel + 1), 2):
        boxes = flat_boxes(shape, start, stop)
        assert len(boxes) <= 2 * len(shape) - 1, (shape, start, stop, boxes)
        at = start
        for offsets, sizes, flat_start in boxes:
            assert flat_start == at, (shape, start, stop, boxes)
            block = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            assert torch.equal(block.reshape(-1), torch.arange(at, at + math.prod(sizes)))  # contiguous
            at += math.prod(sizes)
        assert at == stop, (shape, start, stop, boxes)


def test_empty_range_has_no_boxes():
    assert flat_boxes((4, 4), 5, 5) == []
