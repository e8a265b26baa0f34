"""The step's dense gradient, summed in one order whoever computed what.

Each microbatch of a step goes through the model on its own, and its gradient is kept in
the slot of its position (0..M-1) of one flat buffer; the buffer's all-reduce adds only
zeros to each slot (one trainer computed it), so every trainer then holds every
microbatch's gradient exactly, and sums the slots in position order. The step's update is
therefore the same bits with one trainer, two, or a survivor that took a dead peer's share,
and the same as ``cpr verify --replay`` computes in one process (docs/CHAOS.md). The price
is M times the gradient in the all-reduce (the dense model is the small half of DLRM) and
M backward passes of one microbatch each instead of one over the trainer's share.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

__all__ = ["MicrobatchGrads", "dense_digest"]


class MicrobatchGrads:
    def __init__(self, params: list[torch.Tensor], microbatches: int):
        self.sizes = [p.numel() for p in params]
        self.size = sum(self.sizes)
        self.m = microbatches
        self.flat = self._new()

    def _new(self) -> torch.Tensor:
        # [slot 0 | slot 1 | ... | slot M-1 | failed-here flag | microbatch count]
        return torch.zeros(self.m * self.size + 2)

    def clear(self) -> None:
        """A fresh buffer for the next step: an all-reduce a trainer walked away from may
        still write its result into the old one when gloo's receive ends (collective.py)."""
        self.flat = self._new()

    def keep(self, position: int, params: list[torch.Tensor]) -> None:
        """Moves the gradient in ``params`` (one microbatch's) into slot ``position``."""
        at = position * self.size
        for p, n in zip(params, self.sizes):
            self.flat[at: at + n].copy_(p.grad.reshape(-1))
            p.grad.zero_()
            at += n

    def backward(self, model: torch.nn.Module, params: list[torch.Tensor], positions: list[int], looked_up: np.ndarray,
                 dense: np.ndarray, labels: np.ndarray, rows: int) -> tuple[np.ndarray, float]:
        """A trainer's share of the step: each microbatch (``rows`` rows of the arrays, in the
        order of ``positions``) through ``model`` on its own, its pooled embeddings its own leaf
        (a slice of one shared leaf would add a gradient of the whole share into it at every
        backward), its dense gradient into its position's slot, scaled so that the slots' sum is
        the gradient of the step's mean loss over all M. Returns the pooled embeddings'
        gradients (for the shards) and the share's summed loss."""
        loss_total, pooled_grad = 0.0, np.empty_like(looked_up)
        dense_t, labels_t = torch.from_numpy(dense), torch.from_numpy(labels)
        for j, position in enumerate(positions):
            a, b = j * rows, (j + 1) * rows
            pooled = torch.from_numpy(looked_up[a:b]).requires_grad_(True)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense_t[a:b], pooled), labels_t[a:b],
                                                                        reduction="sum")
            (loss / (self.m * rows)).backward()
            self.keep(position, params)
            pooled_grad[a:b] = pooled.grad.numpy()
            loss_total += loss.item()
        return pooled_grad, loss_total

    def set_extra(self, failed: bool, microbatches: int) -> torch.Tensor:
        self.flat[-2], self.flat[-1] = float(failed), float(microbatches)
        return self.flat

    def sum_into(self, params: list[torch.Tensor]) -> None:
        """After the all-reduce: the slots summed in position order, into each ``p.grad``."""
        slots = self.flat[: self.m * self.size].view(self.m, self.size)
        total = slots[0].clone()
        for i in range(1, self.m):
            total += slots[i]
        at = 0
        for p, n in zip(params, self.sizes):
            p.grad.copy_(total[at: at + n].view_as(p))
            at += n


def dense_digest(params: list[torch.Tensor], sums: list[torch.Tensor]) -> str:
    """What an audited commit records of the dense state it left, for ``cpr verify --replay``:
    blake2b (8 bytes, hex) over every parameter's float32 values, in order, then every
    Adagrad sum's."""
    h = hashlib.blake2b(digest_size=8)
    for t in [*params, *sums]:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()
