"""The dense half of DLRM, built from torchrec's own arches (DenseArch, InteractionArch,
OverArch). The sparse half lives in EmbeddingShard actors, so the model takes pooled
embeddings as an input tensor instead of owning an EmbeddingBagCollection.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch

__all__ = ["DenseModel"]


class DenseModel(nn.Module):
    """DLRM without its embeddings.

    Args:
        num_dense: F_d, dense features per sample (13 for Criteo).
        num_sparse: F, sparse features per sample (26 for Criteo).
        dense_arch: DenseArch layer sizes, last = D.
        over_arch: OverArch layer sizes, last = 1.

    forward(dense B X F_d, sparse B X F X D) -> logits B
    """

    def __init__(self, num_dense: int, num_sparse: int, dense_arch: list[int], over_arch: list[int]):
        super().__init__()
        dim = dense_arch[-1]
        self.dense_arch = DenseArch(in_features=num_dense, layer_sizes=list(dense_arch))
        self.inter_arch = InteractionArch(num_sparse_features=num_sparse)
        over_in = dim + (num_sparse + 1) * num_sparse // 2
        self.over_arch = OverArch(in_features=over_in, layer_sizes=list(over_arch))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        embedded_dense = self.dense_arch(dense)
        return self.over_arch(self.inter_arch(embedded_dense, sparse)).squeeze(-1)
