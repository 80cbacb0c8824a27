"""Triton spec-loop kernels (engine.speculative.tree_kernels) against the torch references, bit for bit.

The kernels run on CPU through Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported, hence a subprocess); on a GPU the same checks run compiled (tests/test_cuda_graph.py).
Trees: well-formed EAGLE trees of several (S, k, n) and corrupted ones (negative candidate ids,
parent ids out of range: pitfall 19), predictions that follow the tree with high probability so
walks accept 0..S drafts.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHECK = textwrap.dedent('''
    import sys
    import numpy as np, torch
    from engine.speculative import tree_kernels as K
    from engine.speculative.tree import build_tree, verify_tree_greedy
    from engine.attention.packed_mask import pack_masks, pack_verify_mask
    dev = sys.argv[1]
    assert K.triton_enabled(torch.zeros(1, device=dev)), "Triton kernels not selected"
    g = torch.Generator().manual_seed(0)
    counts = {"trees": 0, "dropped": 0, "accepted": [0] * 6}
    for trial in range(48):
        S, k = (1, 2, 3, 4)[trial % 4], (1, 2, 3)[trial % 3]
        C = k + (S - 1) * k * k
        n = min(2 + trial % 7, C + 1)
        B, P = 1 + trial % 5, k * (S - 1) + 1
        tsi = torch.stack([torch.sort(torch.randperm(C, generator=g)[:n - 1]).values for _ in range(B)])
        parents = torch.cat([torch.full((B, 1), -1), torch.stack(
            [torch.sort(torch.randperm(C, generator=g)[:P - 1]).values for _ in range(B)])], 1)
        if trial % 2:
            tsi[torch.rand(B, n - 1, generator=g) < 0.15] = -3
            parents[torch.rand(B, P, generator=g) < 0.15] = 10 ** 6
        toks = torch.randint(0, 4, (B, n), generator=g)
        seq = torch.randint(0, 50, (B,), generator=g)
        args = [x.to(dev) for x in (toks[:, 0], parents, tsi, toks[:, 1:], seq)]
        ref = build_tree(*[x.cpu() for x in args], k)
        got = K.build_tree_any(*args, k)
        for f in ref.__dataclass_fields__:
            assert torch.equal(getattr(ref, f), getattr(got, f).cpu()), (trial, f)
        counts["trees"] += B
        counts["dropped"] += int((~ref.valid).sum())
        # predictions: the first child's token with probability 0.7, else random
        follow = ref.candidates.gather(1, ref.next_token.clamp(min=0))
        pred = torch.where(torch.rand(B, n, generator=g) < 0.7, follow, torch.randint(0, 4, (B, n), generator=g))
        r1 = verify_tree_greedy(ref, pred, S)
        r2 = K.verify_tree_greedy_any(type(ref)(*[getattr(got, f) for f in ref.__dataclass_fields__]), pred.to(dev), S)
        for f in r1.__dataclass_fields__:
            assert torch.equal(getattr(r1, f), getattr(r2, f).cpu()), (trial, f)
        for a in r1.num_accepted.tolist():
            counts["accepted"][a] += 1
        L = torch.randint(0, 40, (B,), generator=g).tolist()
        packed, ind = pack_verify_mask(got.tree_mask, L)
        want, wind = pack_masks([torch.cat([torch.ones(n, L[b], dtype=torch.bool), ref.tree_mask[b]], 1)
                                 for b in range(B)])
        assert np.array_equal(packed.cpu().numpy(), want) and np.array_equal(ind, wind), trial
    print("COUNTS", counts)
''')


def run_check(dev: str, extra_env: dict) -> str:
    path = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = {**os.environ, "PYTHONPATH": path, "PPSPEC_TRITON": "1", **extra_env}
    p = subprocess.run([sys.executable, "-c", CHECK, dev], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_triton_kernels_match_torch_interpreted():
    out = run_check("cpu", {"TRITON_INTERPRET": "1"})
    counts = eval(out.split("COUNTS", 1)[1])
    assert counts["trees"] == 141
    assert counts["dropped"] > 20                        # corrupted trees did drop nodes
    acc = counts["accepted"]
    assert acc[0] > 0 and acc[1] > 0 and acc[2] > 0 and acc[3] > 0     # walks of several lengths


def test_pack_verify_mask_host_matches_pack_masks():
    """The host (numpy) path of pack_verify_mask, used for host trees by the verify graph: the same bytes as
    packing each request's full [n, L + n] mask, padding requests (L = 0, all-ones block) included."""
    import numpy as np
    import torch
    from engine.attention.packed_mask import pack_masks, pack_verify_mask
    g = torch.Generator().manual_seed(3)
    for B, n in ((1, 4), (5, 6), (3, 12)):
        tm = torch.rand(B, n, n, generator=g) < 0.5
        L = [int(x) for x in torch.randint(0, 70, (B,), generator=g)]
        L[0] = 0
        packed, indptr = pack_verify_mask(tm, L)
        want, wind = pack_masks([torch.cat([torch.ones(n, L[b], dtype=torch.bool), tm[b]], 1) for b in range(B)])
        assert packed.dtype == torch.uint8 and np.array_equal(packed.numpy(), want) and np.array_equal(indptr, wind)
