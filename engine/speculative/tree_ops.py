"""Where each stage builds and the last stage walks verify trees (the plan's ``tree``).

``HostTreeOps``: host trees, built and walked with the numpy twins (:mod:`engine.speculative.tree_host`).
``DeviceTreeOps`` (``spec_device_tree``): trees stay on the accelerator, walked with the Triton twins
(:mod:`engine.speculative.tree_kernels`). Both give the torch reference's (:mod:`engine.speculative.tree`) outputs.
"""
from __future__ import annotations

import torch

from ..kernels.argmax import argmax_rows
from ..attention.backend import d2h, h2d
from ..messages import DraftTree
from .tree import TreeInfo, VerifyResult
from .tree_host import build_tree_host, verify_tree_greedy_host
from .tree_kernels import build_tree_any, verify_tree_greedy_any


def check_roots(reqs, tokens: torch.Tensor) -> None:
    """Raise RuntimeError when a tree's root ``tokens[b, 0]`` is not request b's last emitted token."""
    for r, t in zip(reqs, tokens[:, 0].tolist()):
        if t != r.root_token:
            raise RuntimeError(f"request {r.rid}: relayed tree root {t} != last emitted token {r.root_token}")


class HostTreeOps:
    """Trees as host data (relayed round the PP ring)."""

    device_tree = False

    def build(self, reqs, topk: int) -> TreeInfo:
        """The verify ``TreeInfo`` of ``reqs`` from their host tree rows (``r.tree``), roots checked."""
        tree = DraftTree.stack([r.tree for r in reqs])
        check_roots(reqs, tree.tokens)
        seq_lens = torch.tensor([r.seq_len for r in reqs], dtype=torch.int64)
        return build_tree_host(tree.tokens[:, 0], tree.parent_list, tree.top_scores_index, tree.tokens[:, 1:],
                               seq_lens, topk)

    def verify_greedy(self, tree: TreeInfo, logits: torch.Tensor, num_steps: int) -> VerifyResult:
        """Greedy walk of the host ``tree`` against logits [B*n, V]: one device->host copy of the argmax [B, n]."""
        B, n = tree.candidates.shape
        return verify_tree_greedy_host(tree, d2h(logits.argmax(-1).view(B, n)), num_steps)

    def relay(self, tree: DraftTree) -> DraftTree:
        """The next trees as relay data: on the host, in one device->host copy."""
        return tree.to_host()


class DeviceTreeOps:
    """Trees resident on ``device``."""

    device_tree = True

    def __init__(self, device):
        self.device = device

    def build(self, reqs, topk: int) -> TreeInfo:
        """The verify ``TreeInfo`` of ``reqs`` on the device; rows still on the host (a request's first tree, from
        its prefill) are root-checked and joined in one pinned copy per field, device rows are used as they are."""
        tree = DraftTree.stack([r.tree for r in reqs], self.device)
        host = [r for r in reqs if r.tree.tokens.device.type == "cpu"]
        if host:
            check_roots(host, torch.stack([r.tree.tokens for r in host]))
        seq_lens = torch.tensor([r.seq_len for r in reqs], dtype=torch.int64)
        return build_tree_any(tree.tokens[:, 0], tree.parent_list, tree.top_scores_index, tree.tokens[:, 1:],
                              h2d(seq_lens, self.device), topk)

    def verify_greedy(self, tree: TreeInfo, logits: torch.Tensor, num_steps: int) -> VerifyResult:
        """Greedy walk on the device (one Triton launch on CUDA); nothing is read back."""
        B, n = tree.candidates.shape
        return verify_tree_greedy_any(tree, argmax_rows(logits).view(B, n), num_steps)

    def relay(self, tree: DraftTree) -> DraftTree:
        """The next trees kept on the device, as an owned copy (graph output buffers are overwritten)."""
        return tree.to_host(to_host=False)
