"""core.model's arches against torchrec's: same parameters from the same seed, same
state-dict keys, same outputs and gradients."""

import copy

import torch

from core.model import DenseModel, torchrec_dense_model


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


def test_dense_adagrad_steps_and_state_match_torchs_adagrad_bit_for_bit():
    from core.model import DenseAdagrad, DenseModel

    torch.manual_seed(3)
    ours_model = DenseModel(13, 26, [32, 8], [16, 1])
    theirs_model = copy.deepcopy(ours_model)
    ours = DenseAdagrad(ours_model.parameters(), lr=0.05)
    theirs = torch.optim.Adagrad(theirs_model.parameters(), lr=0.05)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        dense, sparse = torch.randn(16, 13, generator=g), torch.randn(16, 26, 8, generator=g)
        for model, opt in ((ours_model, ours), (theirs_model, theirs)):
            opt.zero_grad(set_to_none=False)
            model(dense, sparse).sum().backward()
            opt.step()
        if step == 1:
            # States cross over: a checkpoint of either loads into the other.
            ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
            theirs.load_state_dict(copy.deepcopy(ours.state_dict()))
    for a, b in zip(ours_model.parameters(), theirs_model.parameters()):
        assert torch.equal(a, b)
    mine, ref = ours.state_dict(), theirs.state_dict()
    assert mine["param_groups"] == ref["param_groups"]
    for k in ref["state"]:
        assert torch.equal(mine["state"][k]["sum"], ref["state"][k]["sum"])
        assert torch.equal(mine["state"][k]["step"], ref["state"][k]["step"])
