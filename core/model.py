"""The dense half of DLRM: the bottom MLP (DenseArch), the pairwise dot-product interaction
(InteractionArch) and the top MLP (OverArch). The sparse half lives in EmbeddingShard
actors, so the model takes pooled embeddings as an input tensor instead of owning an
EmbeddingBagCollection.

The three arches compute what torchrec's ``torchrec.models.dlrm`` arches compute, with the
same parameters in the same order (so the same seed gives the same initial model) and the
same state-dict keys (so checkpoints load into torchrec's DLRM, see ``app.export``). They
are written here so that a trainer does not import torchrec, which loads fbgemm's kernels:
about 1.5 s of CPU in every trainer's start, on the critical path of the run's first step.
``tests/unit/test_model.py`` checks them against torchrec's.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DenseAdagrad", "DenseModel", "DenseArch", "InteractionArch", "OverArch", "torchrec_dense_model"]


class _Perceptron(nn.Module):
    """Linear layer then activation; attribute names as torchrec's Perceptron."""

    def __init__(self, in_size: int, out_size: int):
        super().__init__()
        self._linear = nn.Linear(in_size, out_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self._linear(x))


class _MLP(nn.Module):
    """Perceptrons with ReLU after every layer; attribute names as torchrec's MLP."""

    def __init__(self, in_size: int, layer_sizes: list[int]):
        super().__init__()
        sizes = [in_size, *layer_sizes]
        self._mlp = nn.Sequential(*[_Perceptron(sizes[i], sizes[i + 1]) for i in range(len(layer_sizes))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mlp(x)


class DenseArch(nn.Module):
    """Bottom MLP: dense features B X F_d -> B X D (ReLU after every layer)."""

    def __init__(self, in_features: int, layer_sizes: list[int]):
        super().__init__()
        self.model = _MLP(in_features, list(layer_sizes))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class InteractionArch(nn.Module):
    """Dot products of every pair among the dense vector and the F pooled embeddings, after
    the dense vector: B X D, B X F X D -> B X (D + (F+1)F/2)."""

    def __init__(self, num_sparse_features: int):
        super().__init__()
        self.F = num_sparse_features
        self.register_buffer("triu_indices", torch.triu_indices(self.F + 1, self.F + 1, offset=1), persistent=False)

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        interactions = torch.bmm(combined, torch.transpose(combined, 1, 2))
        flat = interactions[:, self.triu_indices[0], self.triu_indices[1]]
        return torch.cat((dense_features, flat), dim=1)


class OverArch(nn.Module):
    """Top MLP: ReLU after every layer but the last, which gives the logit."""

    def __init__(self, in_features: int, layer_sizes: list[int]):
        super().__init__()
        if len(layer_sizes) <= 1:
            raise ValueError("OverArch must have multiple layers.")
        self.model = nn.Sequential(
            _MLP(in_features, list(layer_sizes[:-1])), nn.Linear(layer_sizes[-2], layer_sizes[-1], bias=True)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


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


def torchrec_dense_model(num_dense: int, num_sparse: int, dense_arch: list[int], over_arch: list[int]) -> nn.Module:
    """The same model built from torchrec's own arches (imports torchrec): the reference
    that the benchmark's single-process baseline and the tests use."""
    # import cost: torchrec takes 3.1 s (it loads fbgemm), which trainers never pay: they train
    # with the arches above.
    from torchrec.models.dlrm import DenseArch as TDenseArch
    from torchrec.models.dlrm import InteractionArch as TInteractionArch
    from torchrec.models.dlrm import OverArch as TOverArch

    class TorchrecDense(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense_arch = TDenseArch(num_dense, list(dense_arch))
            self.inter_arch = TInteractionArch(num_sparse)
            self.over_arch = TOverArch(dense_arch[-1] + (num_sparse + 1) * num_sparse // 2, list(over_arch))

        def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
            return self.over_arch(self.inter_arch(self.dense_arch(dense), sparse)).squeeze(-1)

    return TorchrecDense()


class DenseAdagrad:
    """Adagrad for the dense parameters: the update and the ``state_dict`` of
    ``torch.optim.Adagrad`` with its defaults (no lr decay, no weight decay, eps 1e-10,
    the single-tensor CPU path), bit for bit, so checkpoints and peers' states load either way.

    Why not ``torch.optim.Adagrad`` itself: a torch optimizer's first construction and first
    step import ``torch._dynamo`` (about 800 modules, sympy among them): 0.9 s of CPU alone,
    1.6 s inside a replacement trainer on 2 busy cores, every time Ray Train starts one.
    """

    def __init__(self, params, lr: float, eps: float = 1e-10):
        self.params = [p for p in params]
        self.lr, self.eps = float(lr), float(eps)
        self.state: dict[int, dict[str, torch.Tensor]] = {
            i: {"step": torch.tensor(0.0), "sum": torch.zeros_like(p, memory_format=torch.preserve_format)}
            for i, p in enumerate(self.params)
        }

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            st = self.state[i]
            st["step"] += 1
            st["sum"].addcmul_(p.grad, p.grad, value=1)
            p.addcdiv_(p.grad, st["sum"].sqrt().add_(self.eps), value=-self.lr)

    def state_dict(self) -> dict:
        group = {
            "lr": self.lr, "lr_decay": 0, "weight_decay": 0, "initial_accumulator_value": 0, "eps": self.eps,
            "foreach": None, "maximize": False, "differentiable": False, "fused": None,
            "params": list(range(len(self.params))),
        }
        return {"state": {i: {"step": st["step"], "sum": st["sum"]} for i, st in self.state.items()},
                "param_groups": [group]}

    def load_state_dict(self, sd: dict) -> None:
        """Takes this class's state or ``torch.optim.Adagrad``'s (same layout); copies, as
        torch does, so the caller's tensors are not aliased."""
        [group] = sd["param_groups"]
        if len(group["params"]) != len(self.params):
            raise ValueError(f"optimizer state has {len(group['params'])} parameters, the model {len(self.params)}")
        self.lr, self.eps = float(group["lr"]), float(group["eps"])
        for pos, key in enumerate(group["params"]):
            st = sd["state"].get(key)
            if st is None:  # a parameter never stepped
                self.state[pos] = {"step": torch.tensor(0.0), "sum": torch.zeros_like(self.params[pos])}
                continue
            step = st["step"]
            self.state[pos] = {
                "step": step.detach().clone().to(torch.float32) if torch.is_tensor(step) else torch.tensor(float(step)),
                "sum": st["sum"].detach().clone().to(self.params[pos].dtype),
            }
