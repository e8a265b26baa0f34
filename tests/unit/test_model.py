"""app.model's arches against torchrec's: same parameters from the same seed, same
state-dict keys, same outputs and gradients."""

import torch

from app.model import DenseModel, torchrec_dense_model


def test_dense_model_matches_torchrecs_arches():
    sizes = (13, 26, [32, 8], [16, 4, 1])
    torch.manual_seed(3)
    ours = DenseModel(*sizes)
    torch.manual_seed(3)
    theirs = torchrec_dense_model(*sizes)
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k

    g = torch.Generator().manual_seed(0)
    dense = torch.randn(64, 13, generator=g)
    sparse = torch.randn(64, 26, 8, generator=g)
    outs = []
    for model in (ours, theirs):
        pooled = sparse.clone().requires_grad_(True)
        out = model(dense, pooled)
        out.sum().backward()
        outs.append((out.detach(), pooled.grad, [p.grad for p in model.parameters()]))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
    for x, y in zip(outs[0][2], outs[1][2]):
        assert torch.equal(x, y)


def test_over_arch_needs_two_layers():
    import pytest

    with pytest.raises(ValueError, match="multiple layers"):
        DenseModel(13, 26, [8], [1])
