"""The step's dense gradient is the same bits however the trainers split its microbatches
(``actors.trainer.grads``): each microbatch's gradient sits in its position's slot, the
all-reduce adds only zeros to a slot, and the slots are summed in position order. Before,
each trainer back-propagated its share as one batch and the all-reduce summed the shares:
two trainers' (0, 2) + (1, 3) and a lone survivor's (0, 1, 2, 3) parted in the last bits."""

import functools

import pytest
import torch

from actors.trainer.grads import MicrobatchGrads
from core.model import DenseModel

pytestmark = pytest.mark.timeout(60)

M, ROWS = 4, 64


def _data():
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(ROWS, 13, generator=gen), torch.randn(ROWS, 26, 8, generator=gen),
             (torch.rand(ROWS, generator=gen) < 0.3).float()) for _ in range(M)]


def _step_gradient(split, batched=False):
    torch.manual_seed(1)
    model = DenseModel(13, 26, [32, 8], [32, 1])
    params = list(model.parameters())
    data = _data()
    flats = []
    for share in split:
        for p in params:
            p.grad = torch.zeros_like(p)
        grads = MicrobatchGrads(params, M)
        if batched:  # the old way: the share as one batch, into slot 0
            dense, pooled, labels = (torch.cat([data[i][j] for i in share]) for j in range(3))
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, pooled), labels, reduction="sum")
            (loss / (M * ROWS)).backward()
            grads.keep(0, params)
        else:  # what a trainer does with its share (``MicrobatchGrads.backward``)
            dense, pooled, labels = (torch.cat([data[i][j] for i in share]).numpy() for j in range(3))
            pooled_grad, _ = grads.backward(model, params, list(share), pooled, dense, labels, ROWS)
            assert pooled_grad.shape == pooled.shape and pooled_grad.any()
        flats.append(grads.set_extra(False, len(share)))
    summed = functools.reduce(torch.add, flats)  # the all-reduce, in whatever order
    grads.flat = summed
    grads.sum_into(params)
    return [p.grad.clone() for p in params], summed[-1].item()


SPLITS = [[(0, 1, 2, 3)], [(0, 2), (1, 3)], [(1, 3), (0, 2)], [(0,), (1,), (2,), (3,)], [(3, 0), (1,), (2,)]]


def test_any_split_gives_the_same_bits():
    whole, count = _step_gradient(SPLITS[0])
    assert count == M
    for split in SPLITS[1:]:
        grads, count = _step_gradient(split)
        assert count == M
        assert all(torch.equal(a, b) for a, b in zip(whole, grads)), split


def test_summing_whole_shares_does_not():
    """The reason for the slots: shares back-propagated as batches part in the last bits."""
    one, _ = _step_gradient([(0, 1, 2, 3)], batched=True)
    two, _ = _step_gradient([(0, 2), (1, 3)], batched=True)
    assert not all(torch.equal(a, b) for a, b in zip(one, two))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(one, two))
