"""Triton spec-loop kernels (engine.speculative.tree_kernels: tree build, greedy walk; verify-mask packing) against
the torch references, bit for bit (helpers.tree_kernel_counts), on CPU through Triton's interpreter or compiled on
the GPU. Trees: well-formed EAGLE trees of several (S, k, n) and corrupted ones (negative candidate ids, parent ids
out of range); predictions follow the tree with high probability so walks accept 0..S drafts."""
from __future__ import annotations

from helpers import kernel_device, tree_kernel_counts


def test_triton_kernels_match_torch(monkeypatch):
    monkeypatch.setenv("PPSPEC_TRITON", "1")
    counts = tree_kernel_counts(kernel_device())
    assert counts["trees"] == 141
    assert counts["dropped"] > 20                        # corrupted trees did drop nodes
    acc = counts["accepted"]
    assert acc[0] > 0 and acc[1] > 0 and acc[2] > 0 and acc[3] > 0     # walks of several lengths
