"""The dense half of the model as the checker computes it, in plain torch: DLRM's bottom MLP,
its pairwise dot interaction and its top MLP (arXiv 1906.00091, section 2), with Adagrad.

Written here, not imported: the replay must not take the product's word for what a step
computes. The layers are made in the order the model's definition gives them (bottom MLP,
then top MLP, each layer's weight before its bias), so ``torch.manual_seed(seed)`` followed
by ``DenseDLRM(...)`` draws the same initial parameters as any implementation that builds
``nn.Linear`` layers in that order; the parameters' order is also the order of a saved
``state_dict``, which is how ``compare`` pairs them with a checkpoint's."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DenseDLRM", "adagrad"]


class DenseDLRM(nn.Module):
    """forward(dense [B, F_d], pooled [B, F, D]) -> logits [B]."""

    def __init__(self, num_dense: int, num_sparse: int, bottom: list[int], top: list[int]):
        super().__init__()
        sizes = [num_dense, *bottom]
        self.bottom = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        pairs = (num_sparse + 1) * num_sparse // 2
        sizes = [bottom[-1] + pairs, *top]
        self.top = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        upper = torch.triu_indices(num_sparse + 1, num_sparse + 1, offset=1)
        self.register_buffer("pair_rows", upper[0], persistent=False)
        self.register_buffer("pair_cols", upper[1], persistent=False)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        x = dense
        for layer in self.bottom:
            x = torch.relu(layer(x))
        # Every pair of the dense vector and the F pooled embeddings, upper triangle only.
        vectors = torch.cat((x.unsqueeze(1), pooled), dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pair_rows, self.pair_cols]
        y = torch.cat((x, dots), dim=1)
        for layer in self.top[:-1]:
            y = torch.relu(layer(y))
        return self.top[-1](y).squeeze(-1)


def adagrad(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """Adagrad with torch's defaults (eps 1e-10, no decay), one tensor at a time."""
    return torch.optim.Adagrad(model.parameters(), lr=lr, foreach=False)
