"""Tests for engine/speculative/tree.py: worked examples of pp-spec-notes §2.4, SGLang's unit-test vectors,
invalid trees (pitfall 19), the chain fallback, exactness of tree rejection sampling, and exact
agreement of the host (numpy) twins build_tree_host / verify_tree_greedy_host with the torch ones."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from engine.speculative.tree import (TreeInfo, VerifyResult, build_tree, chain_fallback, draft_step_select, organize_draft_results, verify_tree_greedy, verify_tree_sampling)
from engine.speculative.tree_host import build_tree_host, tree_input_hash, verify_tree_greedy_host

T = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731


def _mask(rows):
    return torch.tensor([[bool(int(c)) for c in r.split()] for r in rows])


# ---------------------------------------------------------------- §2.4 (a) chain
def test_chain_example():
    tree = build_tree(T([100]), T([[-1, 0, 1]]), T([[0, 1, 2]]), T([[11, 12, 13]]), T([10]), 1)
    assert tree.candidates.tolist() == [[100, 11, 12, 13]]
    assert tree.positions.tolist() == [[10, 11, 12, 13]]
    assert tree.next_token.tolist() == [[1, 2, 3, -1]]
    assert tree.next_sibling.tolist() == [[-1, -1, -1, -1]]
    assert torch.equal(tree.tree_mask[0], _mask(["1 0 0 0", "1 1 0 0", "1 1 1 0", "1 1 1 1"]))
    assert tree.valid.all() and tree.retrive_index.tolist() == [[0, 1, 2, 3]]
    res = verify_tree_greedy(tree, T([[11, 12, 99, 5]]), num_steps=3)
    assert res.accept_nodes.tolist() == [[0, 1, 2, -1]]
    assert res.num_accepted.tolist() == [2] and res.accept_length.tolist() == [3]
    assert res.emitted.tolist() == [[11, 12, 99, -1]] and res.bonus.tolist() == [99]


# ---------------------------------------------------------------- §2.4 (b) tree
R, A, B_, C, D, E, F, I, J, G, H = 100, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10


def _example_b():
    scores, tokens, parents = [], [], []
    bs, bt, pb, s, t, p = draft_step_select(0, 2, None, torch.tensor([[[.60, .35]]]), T([[[A, B_]]]))
    assert bt.tolist() == [[A, B_]] and p.tolist() == [[-1, 0, 1]] and pb.tolist() == [[0, 0]]
    scores.append(s), tokens.append(t), parents.append(p)
    bs, bt, pb, s, t, p = draft_step_select(1, 2, bs, torch.tensor([[[.5, .4], [.9, .05]]]),
                                            T([[[C, D], [E, F]]]))
    assert bt.tolist() == [[E, C]] and pb.tolist() == [[1, 0]] and p.tolist() == [[4, 2]]
    assert torch.allclose(bs, torch.tensor([[.315, .30]]))
    scores.append(s), tokens.append(t), parents.append(p)
    # step 2 runs on beams [E, C]
    bs, bt, pb, s, t, p = draft_step_select(2, 2, bs, torch.tensor([[[.8, .1], [.7, .2]]]),
                                            T([[[I, J], [G, H]]]))
    assert p.tolist() == [[6, 8]] and bt.tolist() == [[I, G]]
    scores.append(s), tokens.append(t), parents.append(p)
    return organize_draft_results(scores, tokens, parents, num_draft_tokens=6)


def test_tree_example():
    parent_list, top, draft = _example_b()
    assert top.tolist() == [[0, 1, 2, 4, 6]]
    assert parent_list.tolist() == [[-1, 0, 1, 4, 2]]
    assert draft.tolist() == [[A, B_, C, E, I]]
    tree = build_tree(T([R]), parent_list, top, draft, T([10]), 2)
    assert tree.candidates.tolist() == [[R, A, B_, C, E, I]]
    assert tree.positions.tolist() == [[10, 11, 11, 12, 12, 13]]
    assert tree.parent_node.tolist() == [[-1, 0, 0, 1, 2, 4]]
    assert tree.depth.tolist() == [[0, 1, 1, 2, 2, 3]]
    assert tree.next_token.tolist() == [[1, 3, 4, -1, 5, -1]]
    assert tree.next_sibling.tolist() == [[-1, 2, -1, -1, -1, -1]]
    assert torch.equal(tree.tree_mask[0], _mask(["1 0 0 0 0 0", "1 1 0 0 0 0", "1 0 1 0 0 0",
                                                 "1 1 0 1 0 0", "1 0 1 0 1 0", "1 0 1 0 1 1"]))
    pred = T([[B_, 0, E, 0, 42, 0]])  # after R: B; after B (node 2): E; after E (node 4): 42
    res = verify_tree_greedy(tree, pred, num_steps=3)
    assert res.accept_nodes.tolist() == [[0, 2, 4, -1]]
    assert res.num_accepted.tolist() == [2] and res.accept_length.tolist() == [3]
    assert res.emitted.tolist() == [[B_, E, 42, -1]]


def test_draft_step_select_ties_lower_index():
    *_, p = draft_step_select(1, 2, torch.tensor([[.5, .5]]), torch.tensor([[[.4, .4], [.4, .1]]]),
                              T([[[1, 2], [3, 4]]]))
    assert p.tolist() == [[2, 3]]
    pl, top, draft = organize_draft_results([torch.tensor([[.5, .5, .5]])], [T([[7, 8, 9]])],
                                            [T([[-1, 0, 1, 2]])], 3)
    assert top.tolist() == [[0, 1]] and draft.tolist() == [[7, 8]] and pl.tolist() == [[-1]]


# ---------------------------------------------------------------- SGLang vectors
def _sglang_build_inputs():
    # Input values of SGLang's test_build_tree_kernel_efficient (python/sglang/srt/speculative/
    # build_eagle_tree.py): topk=4, depth=4, n=8, seq_lens=[5, 10].
    f = torch.tensor
    scores = [
        f([[[7.1127e-01, 2.8292e-01, 2.2995e-03, 1.7357e-03]],
           [[9.7476e-01, 2.2219e-02, 6.5031e-04, 1.3212e-04]]]),
        f([[[6.9142e-01, 1.2863e-02, 1.6873e-03, 1.1871e-03], [2.4787e-01, 1.8818e-02, 1.4204e-02, 9.2235e-04],
            [2.2971e-03, 1.6700e-06, 1.8737e-07, 8.3146e-08], [1.2771e-03, 2.4374e-04, 1.7832e-04, 1.1947e-05]],
           [[8.4832e-02, 6.6068e-02, 5.8304e-02, 5.7851e-02], [2.3616e-03, 1.1243e-03, 5.4368e-04, 2.7768e-04],
            [2.5286e-04, 1.5578e-04, 2.8817e-05, 1.2888e-05], [1.2834e-04, 2.5417e-06, 1.1279e-06, 1.6088e-08]]]),
        f([[[6.6438e-01, 2.6997e-02, 2.4236e-05, 4.0821e-06], [2.4402e-01, 2.8409e-03, 5.0935e-04, 2.9022e-04],
            [1.6178e-02, 2.0567e-03, 4.5892e-04, 3.0034e-05], [1.3023e-02, 5.0497e-04, 3.6371e-04, 8.7750e-05]],
           [[2.3263e-02, 2.0054e-02, 9.3990e-03, 2.7783e-03], [6.4156e-02, 5.5506e-04, 1.0429e-04, 9.7211e-05],
            [4.9950e-02, 5.0630e-03, 9.0068e-04, 3.3656e-04], [7.5817e-03, 8.5731e-04, 6.9972e-04, 6.0793e-04]]]),
        f([[[6.6420e-01, 1.0525e-04, 6.5864e-05, 1.2253e-06], [1.3019e-01, 1.0461e-01, 5.2083e-03, 1.6777e-03],
            [2.0103e-02, 6.7335e-03, 1.2625e-04, 1.0364e-05], [1.5142e-02, 7.0819e-04, 9.6595e-05, 8.7951e-05]],
           [[5.8608e-02, 1.8840e-03, 7.8535e-04, 4.4400e-04], [1.2185e-02, 2.0684e-03, 1.7418e-03, 1.4327e-03],
            [6.2455e-03, 6.1487e-03, 2.6862e-03, 1.8034e-03], [1.8590e-03, 1.6151e-03, 1.2481e-03, 3.6038e-04]]]),
    ]
    tokens = [
        T([[29896, 29906, 29900, 29945], [13, 2, 29871, 28956]]),
        T([[29889, 29974, 29945, 29900, 29974, 29922, 29930, 29958, 29889, 29974, 29930, 29945, 29974,
            29922, 29930, 29958],
           [22550, 4136, 16492, 8439, 29871, 2, 3001, 13, 2, 13, 29906, 29946, 2, 13, 29871, 259]]),
        T([[29946, 29945, 29953, 29906, 29896, 29945, 29900, 29906, 29896, 29945, 29906, 29953, 29896,
            29945, 29906, 29946],
           [29871, 2, 29901, 29889, 29871, 2, 395, 259, 29901, 29871, 2, 29889, 3001, 1234, 7146, 2186]]),
        T([[29946, 29974, 29945, 29930, 29889, 29922, 29974, 29930, 29974, 29946, 29930, 29922, 29889,
            29974, 29945, 29922],
           [29941, 29906, 2, 29946, 29871, 450, 319, 14990, 29946, 29941, 2, 29906, 29871, 2, 3001, 13]]),
    ]
    parents = [T([[-1, 0, 1, 2, 3], [-1, 0, 1, 2, 3]]), T([[4, 8, 9, 10], [4, 5, 6, 7]]),
               T([[20, 24, 21, 28], [24, 28, 20, 21]]), T([[36, 40, 41, 44], [36, 40, 44, 45]])]
    return organize_draft_results(scores, tokens, parents, num_draft_tokens=8)


def test_sglang_build_tree_vector():
    parent_list, top, draft = _sglang_build_inputs()
    assert parent_list.shape == (2, 4 * 3 + 1)
    tree = build_tree(T([29974, 13]), parent_list, top, draft, T([5, 10]), topk=4)
    assert tree.positions.flatten().tolist() == [5, 6, 6, 7, 7, 8, 8, 9, 10, 11, 12, 12, 12, 12, 13, 14]
    assert tree.retrive_index.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
    assert tree.next_token.tolist() == [[1, 3, 4, 5, 6, 7, -1, -1], [1, 2, -1, 6, -1, -1, 7, -1]]
    assert tree.next_sibling.tolist() == [[-1, 2, -1, -1, -1, -1, -1, -1], [-1, -1, 3, 4, 5, -1, -1, -1]]
    assert tree.candidates.flatten().tolist() == [
        29974, 29896, 29906, 29889, 29974, 29946, 29896, 29946,
        13, 13, 22550, 4136, 16492, 8439, 29871, 29941]
    assert tree.valid.all()
    # mask rows are exactly root + ancestors + self: row sums = depth + 1
    assert torch.equal(tree.tree_mask.sum(-1), tree.depth + 1)


def _sglang_verify_inputs():
    # Input values of SGLang's sgl-kernel test_verify_tree_greedy (links given directly).
    cand = T([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    nt = T([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
    ns = T([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])
    z = torch.zeros(2, 6, dtype=torch.long)
    tree = TreeInfo(cand, z, torch.ones(2, 6, 6, dtype=torch.bool), z, z, nt, ns,
                    torch.arange(12).view(2, 6), torch.ones(2, 6, dtype=torch.bool))
    pred = torch.full((2, 6), 18, dtype=torch.long)
    pred[0, 0], pred[0, 3], pred[0, 4], pred[1, 0], pred[1, 4] = 3, 4, 5, 11, 12
    return tree, pred


def test_sglang_verify_greedy_vector():
    tree, pred = _sglang_verify_inputs()
    res = verify_tree_greedy(tree, pred, num_steps=3)
    assert res.accept_nodes.tolist() == [[0, 3, 4, 5], [0, 4, 5, -1]]
    assert res.num_accepted.tolist() == [3, 2] and res.accept_length.tolist() == [4, 3]
    assert res.emitted.tolist() == [[3, 4, 5, 18], [11, 12, 18, -1]]


# ---------------------------------------------------------------- invalid trees (pitfall 19)
def test_missing_parent_is_dropped_and_unreachable():
    # k=2, S=4: node 5 = c6 (slot 3 -> pid 4, not selected); node 6 = c8 (slot 4 -> pid 6 = dropped)
    tree = build_tree(T([50]), T([[-1, 0, 1, 4, 6, 9, 9]]), T([[0, 1, 2, 3, 6, 8]]),
                      T([[1, 2, 3, 4, 77, 78]]), T([20]), 2)
    assert tree.valid.tolist() == [[True] * 5 + [False, False]]
    assert tree.parent_node.tolist() == [[-1, 0, 0, 1, 1, -1, -1]]
    assert tree.next_token.tolist() == [[1, 3, -1, -1, -1, -1, -1]]
    assert tree.next_sibling.tolist() == [[-1, 2, -1, 4, -1, -1, -1]]
    assert tree.depth[0, 5:].tolist() == [1, 1] and tree.positions[0, 5:].tolist() == [21, 21]
    for r in (5, 6):
        assert tree.tree_mask[0, r].nonzero().flatten().tolist() == [0, r]
    res = verify_tree_greedy(tree, torch.full((1, 7), 77), num_steps=4)
    assert res.num_accepted.tolist() == [0] and res.emitted.tolist() == [[77, -1, -1, -1, -1]]


def test_out_of_range_indices_terminate():
    # candidate ids negative / beyond parent_list, parent ids negative / huge
    tree = build_tree(T([5, 5]), T([[-1, 0, -7], [-1, 99, 1]]), T([[0, -3, 2, 4, 1000], [0, 1, 2, 4, 5]]),
                      T([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]]), T([0, 0]), 2)
    assert tree.valid.tolist() == [[True, True, False, True, False, False],
                                   [True, True, True, False, True, True]]
    assert (tree.parent_node[~tree.valid] == -1).all() and (tree.next_token < 6).all()
    pred = torch.arange(1, 7).repeat(2, 1)  # would accept node r+1 after node r if linked
    res = verify_tree_greedy(tree, pred, num_steps=3)
    assert tree.valid.gather(1, res.accept_nodes.clamp(min=0)).all()


def test_nan_scores_in_organize():
    nan = float("nan")
    s0, t0, p0 = torch.tensor([[nan, .3]]), T([[1, 2]]), T([[-1, 0, 1]])
    bs, _, _, s1, t1, p1 = draft_step_select(1, 2, torch.tensor([[nan, .3]]),
                                             torch.tensor([[[.9, .1], [nan, .5]]]), T([[[3, 4], [5, 6]]]))
    assert p1.tolist() == [[5, 2]]  # NaN ranks last
    pl, top, draft = organize_draft_results([s0, torch.tensor([[.9, .8, .1, .05]])],
                                            [t0, T([[3, 4, 5, 6]])], [p0, T([[2, 3]])], 4)
    assert top.tolist() == [[1, 2, 3]]  # NaN candidate 0 (parent of c2, c3) not selected
    tree = build_tree(T([9]), pl, top, draft, T([3]), 2)
    assert tree.valid.tolist() == [[True, True, False, False]]
    res = verify_tree_greedy(tree, T([[3, 3, 3, 3]]), num_steps=2)
    assert res.accept_length.tolist() == [1]


def test_random_garbage_invariants():
    g = torch.Generator().manual_seed(0)
    B, k, S, n = 64, 3, 4, 12
    pl = torch.randint(-2, 40, (B, k * (S - 1) + 1), generator=g)
    top = torch.sort(torch.randint(-2, 45, (B, n - 1), generator=g), dim=1).values
    tree = build_tree(torch.zeros(B, dtype=torch.long), pl, top, torch.randint(0, 3, (B, n - 1), generator=g),
                      torch.zeros(B, dtype=torch.long), k)
    par = tree.parent_node
    r = torch.arange(n)
    assert ((par < r) | ~tree.valid).all()
    assert tree.valid.gather(1, par.clamp(min=0))[tree.valid].all()
    for links in (tree.next_token, tree.next_sibling):
        assert tree.valid.gather(1, links.clamp(min=0))[links >= 0].all()
    assert torch.equal(tree.tree_mask.sum(-1), tree.depth + 1)
    res = verify_tree_greedy(tree, torch.randint(0, 3, (B, n), generator=g), num_steps=S)
    nodes = res.accept_nodes
    assert tree.valid.any(1).all() and (~tree.valid).any() and (res.num_accepted > 0).any()
    for j in range(1, S + 1):
        ok = nodes[:, j] >= 0
        assert (par.gather(1, nodes[:, j:j + 1].clamp(min=0))[:, 0][ok] == nodes[:, j - 1][ok]).all()


# ---------------------------------------------------------------- chain fallback
@pytest.mark.parametrize("S,k,n", [(3, 1, 4), (3, 2, 6), (2, 2, 4), (1, 3, 3)])
def test_chain_fallback(S, k, n):
    bonus = T([7, 8, 9])
    toks, pl, top = chain_fallback(bonus, S, k, n)
    assert toks[:, 0].tolist() == [7, 8, 9] and (toks[:, 1:] == 0).all()
    assert pl.shape == (3, k * (S - 1) + 1) and top.shape == (3, n - 1)
    tree = build_tree(toks[:, 0], pl, top, toks[:, 1:], T([4, 5, 6]), k)
    assert tree.valid.all() and tree.positions[:, 0].tolist() == [4, 5, 6]
    pred = torch.full((3, n), 5)
    pred[2, 0] = 0
    res = verify_tree_greedy(tree, pred, S)
    assert res.accept_length[:2].tolist() == [1, 1] and res.emitted[:2, 0].tolist() == [5, 5]
    assert res.accept_length[2] >= 2


# ---------------------------------------------------------------- sampling verify
def _sampling_tree(Bn):
    # k=2, S=2: root -> {1 (tok 1), 2 (tok 2)}; node 3 = tok 3 under node 1; node 4 = tok 0 under node 2
    tree = build_tree(torch.full((Bn,), 4), T([[-1, 0, 1]]).expand(Bn, 3), T([[0, 1, 2, 4]]).expand(Bn, 4),
                      T([[1, 2, 3, 0]]).expand(Bn, 4), torch.zeros(Bn, dtype=torch.long), 2)
    assert tree.next_token[0].tolist() == [1, 3, 4, -1, -1]
    return tree


P_NODES = torch.tensor([[.10, .30, .25, .15, .20],   # root
                        [.20, .10, .10, .40, .20],   # after tok 1
                        [.30, .05, .30, .20, .15],   # after tok 2
                        [.30, .20, .20, .20, .10],   # after 1,3
                        [.10, .10, .40, .20, .20]])  # after 2,0


def _chi(samples, p):
    counts = torch.bincount(samples, minlength=p.numel()).double()
    p = p.double() / p.double().sum()
    return chisquare(counts.numpy(), (p * counts.sum()).numpy()).pvalue


def test_sampling_matches_target_distribution():
    Bn = 20000
    g = torch.Generator().manual_seed(1234)
    tree = _sampling_tree(Bn)
    res = verify_tree_sampling(tree, P_NODES.expand(Bn, 5, 5), 2, torch.rand(Bn, 5, generator=g),
                               torch.rand(Bn, generator=g))
    em, L = res.emitted, res.accept_length
    assert _chi(em[:, 0], P_NODES[0]) > 1e-3
    for first, node in ((1, 1), (2, 2)):  # second token given a drafted first token
        sel = em[:, 0] == first
        assert (L[sel] >= 2).all()
        assert _chi(em[sel, 1], P_NODES[node]) > 1e-3
    for (t0, t1), node in (((1, 3), 3), ((2, 0), 4)):  # third token after a full accept
        sel = (em[:, 0] == t0) & (em[:, 1] == t1)
        assert (L[sel] == 3).all() and sel.sum() > 500
        assert _chi(em[sel, 2], P_NODES[node]) > 1e-3
    undrafted = ~torch.isin(em[:, 0], T([1, 2]))
    assert (L[undrafted] == 1).all()
    # accepted drafts are consistent with the node walk
    assert torch.equal(tree.candidates.gather(1, res.accept_nodes.clamp(min=0))[:, 1:][L > 1][:, 0],
                       em[L > 1, 0])


def test_sampling_duplicate_siblings_exact():
    # chain fallback with k=2: both root children carry token 0; must still be exact
    Bn, g = 20000, torch.Generator().manual_seed(7)
    toks, pl, top = chain_fallback(torch.full((Bn,), 3), 2, 2, 4)
    tree = build_tree(toks[:, 0], pl, top, toks[:, 1:], torch.zeros(Bn, dtype=torch.long), 2)
    res = verify_tree_sampling(tree, P_NODES[:4].expand(Bn, 4, 5), 2, torch.rand(Bn, 4, generator=g),
                               torch.rand(Bn, generator=g))
    assert _chi(res.emitted[:, 0], P_NODES[0]) > 1e-3


def test_sampling_one_hot_always_accepts():
    Bn = 1000
    tree = _sampling_tree(Bn)
    p = torch.zeros(5, 5)
    p[0, 2] = p[2, 0] = 1.0        # root -> tok 2 (node 2) -> tok 0 (node 4)
    p[1, 4] = p[3, 4] = 1.0
    p[4, 3] = 1.0                  # bonus after node 4
    coins = torch.rand(Bn, 5)
    coins[0] = 0.0
    res = verify_tree_sampling(tree, p.expand(Bn, 5, 5), 2, coins, torch.rand(Bn))
    assert (res.accept_length == 3).all()
    assert (res.accept_nodes == T([0, 2, 4])).all() and (res.emitted == T([2, 0, 3])).all()
    p2 = torch.zeros(5, 5)
    p2[:, 4] = 1.0                 # target wants an undrafted token: reject all, bonus = 4
    res = verify_tree_sampling(tree, p2.expand(Bn, 5, 5), 2, coins, torch.rand(Bn))
    assert (res.accept_length == 1).all() and (res.bonus == 4).all()


def test_tree_input_hash():
    parent_list, top, draft = _example_b()
    t1 = build_tree(T([R]), parent_list, top, draft, T([10]), 2)
    t2 = build_tree(T([R]), parent_list.clone(), top.clone(), draft.clone(), T([10]), 2)
    assert tree_input_hash(t1) == tree_input_hash(t2)
    t2.tree_mask[0, 5, 3] = True
    assert tree_input_hash(t1) != tree_input_hash(t2)
    t3 = build_tree(T([R]), parent_list, top, draft, T([11]), 2)
    assert tree_input_hash(t1) != tree_input_hash(t3)


# ---------------------------------------------------------------- host (numpy) twins
def _assert_same(ref, got):
    """Every field of two TreeInfo / VerifyResult equal: dtype, shape, values."""
    assert type(ref) is type(got)
    for name in ref.__dataclass_fields__:
        a, b = getattr(ref, name), getattr(got, name)
        assert b.device.type == "cpu", name
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (name, a, b)


def _check_build(args, topk) -> TreeInfo:
    ref = build_tree(*args, topk)
    _assert_same(ref, build_tree_host(*args, topk))
    return ref


def _check_verify(tree, pred, num_steps) -> VerifyResult:
    ref = verify_tree_greedy(tree, pred, num_steps)
    _assert_same(ref, verify_tree_greedy_host(tree, pred, num_steps))
    return ref


def _follow_pred(tree, V, rng, p_follow=0.85):
    """target_predict that, per node, names a random child's token with prob ``p_follow``
    (else a random token in [0, V)), so long acceptance paths occur."""
    B, n = tree.candidates.shape
    par, cand = tree.parent_node.tolist(), tree.candidates.tolist()
    pred = []
    for b in range(B):
        kids = [[] for _ in range(n)]
        for r in range(1, n):
            if 0 <= par[b][r] < n:
                kids[par[b][r]].append(r)
        pred.append([cand[b][rng.choice(kids[r])] if kids[r] and rng.random() < p_follow
                     else rng.randrange(V) for r in range(n)])
    return T(pred)


def test_host_matches_worked_examples():
    import random
    rng = random.Random(0)
    pl_b, top_b, draft_b = _example_b()
    pl_s, top_s, draft_s = _sglang_build_inputs()
    nan = float("nan")
    pl_n, top_n, draft_n = organize_draft_results(
        [torch.tensor([[nan, .3]]), torch.tensor([[.9, .8, .1, .05]])], [T([[1, 2]]), T([[3, 4, 5, 6]])],
        [T([[-1, 0, 1]]), T([[2, 3]])], 4)
    cases = [  # (build_tree args, topk, target_predict, num_steps)
        ((T([100]), T([[-1, 0, 1]]), T([[0, 1, 2]]), T([[11, 12, 13]]), T([10])), 1, T([[11, 12, 99, 5]]), 3),
        ((T([R]), pl_b, top_b, draft_b, T([10])), 2, T([[B_, 0, E, 0, 42, 0]]), 3),
        ((T([29974, 13]), pl_s, top_s, draft_s, T([5, 10])), 4, None, 4),
        ((T([50]), T([[-1, 0, 1, 4, 6, 9, 9]]), T([[0, 1, 2, 3, 6, 8]]), T([[1, 2, 3, 4, 77, 78]]), T([20])),
         2, torch.full((1, 7), 77), 4),
        ((T([5, 5]), T([[-1, 0, -7], [-1, 99, 1]]), T([[0, -3, 2, 4, 1000], [0, 1, 2, 4, 5]]),
          T([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]]), T([0, 0])), 2, torch.arange(1, 7).repeat(2, 1), 3),
        ((T([9]), pl_n, top_n, draft_n, T([3])), 2, T([[3, 3, 3, 3]]), 2),
        ((torch.full((3,), 4), T([[-1, 0, 1]]).expand(3, 3), T([[0, 1, 2, 4]]).expand(3, 4),
          T([[1, 2, 3, 0]]).expand(3, 4), torch.zeros(3, dtype=torch.long)), 2, None, 2),
    ]
    for S, k, n in [(3, 1, 4), (3, 2, 6), (2, 2, 4), (1, 3, 3)]:
        toks, pl, top = chain_fallback(T([7, 8, 9]), S, k, n)
        pred = torch.full((3, n), 5)
        pred[2, 0] = 0
        cases.append(((toks[:, 0], pl, top, toks[:, 1:], T([4, 5, 6])), k, pred, S))
    lens = set()
    for args, k, pred, S in cases:
        tree = _check_build(args, k)
        for p in ([pred] if pred is not None else []) + [_follow_pred(tree, 100, rng, 1.0)]:
            lens.update(_check_verify(tree, p, S).accept_length.tolist())
    tree, pred = _sglang_verify_inputs()
    lens.update(_check_verify(tree, pred, 3).accept_length.tolist())
    assert {1, 3, 4} <= lens
    # numpy inputs are accepted as well
    args, k, pred, S = cases[1]
    tree = build_tree(*args, k)
    _assert_same(tree, build_tree_host(*(a.numpy() for a in args), k))
    _assert_same(verify_tree_greedy(tree, pred, S), verify_tree_greedy_host(tree, pred.numpy(), S))


SHAPES = [(3, 1, 4), (4, 4, 12), (5, 8, 64), (2, 2, 3), (1, 1, 1), (3, 2, 6), (2, 2, 4), (1, 3, 3),
          (4, 4, 8), (4, 3, 12), (2, 2, 5)]


def _random_draft(B, S, k, n, V, g, ties):
    """Real draft pipeline (draft_step_select + organize_draft_results) on random top-k
    probabilities over a vocabulary of V tokens; ``ties`` quantises them (ties, zeros)."""
    scores, tokens, parents, beam = [], [], [], None
    for step in range(S):
        probs = torch.softmax(2 * torch.randn(B, 1 if step == 0 else k, V, generator=g), -1)
        if ties:
            probs = (probs * 4).round() / 4
        top_p, top_t = probs.topk(k, dim=-1)
        beam, _, _, sc, tk, pa = draft_step_select(step, k, beam, top_p, top_t)
        scores.append(sc), tokens.append(tk), parents.append(pa)
    return organize_draft_results(scores, tokens, parents, n)


@pytest.mark.parametrize("S,k,n", SHAPES)
def test_host_matches_random_pipeline(S, k, n):
    import random
    seed0 = S * 1000 + k * 100 + n
    rng, g = random.Random(seed0), torch.Generator().manual_seed(seed0)
    V, lens = k + 2, []
    for B in (1, 3, 8):
        for seed in range(12):
            pl, top, draft = _random_draft(B, S, k, n, V, g, ties=seed % 3 == 2)
            args = (torch.randint(0, V, (B,), generator=g), pl, top, draft,
                    torch.randint(0, 50, (B,), generator=g))
            tree = _check_build(args, k)
            assert tree.valid.all()  # the real pipeline never yields a dropped node
            for pred in (torch.randint(0, V, (B, n), generator=g), _follow_pred(tree, V, rng)):
                lens += _check_verify(tree, pred, S).accept_length.tolist()
    assert 1 in lens and max(lens) >= min(3, S + 1, n)  # not vacuous: short and long accepts


@pytest.mark.parametrize("S,k,n", SHAPES)
def test_host_matches_random_garbage(S, k, n):
    import random
    rng, g = random.Random(7 + n), torch.Generator().manual_seed(S * 1000 + k * 100 + n + 1)
    P, V, lens, dropped = k * (S - 1) + 1, 3, [], 0
    for B in (1, 3, 8):
        for seed in range(12):
            dt = torch.int32 if seed % 4 == 3 else torch.long
            pl = torch.randint(-3, P * k + 6, (B, P), generator=g)
            top = torch.randint(-3, P * k + 6, (B, n - 1), generator=g)
            if seed % 2:
                top = top.sort(1).values  # ascending as documented, still invalid
            if seed % 3 == 0:  # mostly-valid ids with duplicates, so deep trees occur too
                top = torch.sort(torch.randint(0, min(P * k, n + 2), (B, n - 1), generator=g), 1).values
                pl = torch.arange(-1, P - 1).repeat(B, 1)
            args = tuple(x.to(dt) for x in (torch.randint(0, V, (B,), generator=g), pl, top,
                                            torch.randint(0, V, (B, n - 1), generator=g),
                                            torch.randint(0, 50, (B,), generator=g)))
            tree = _check_build(args, k)
            dropped += int((~tree.valid).sum())
            for pred in (torch.randint(0, V, (B, n), generator=g).to(dt), _follow_pred(tree, V, rng)):
                lens += _check_verify(tree, pred, S).accept_length.tolist()
            # garbage links: out of range, cycles, dropped nodes, sibling chains longer than n
            bad = TreeInfo(tree.candidates, tree.positions, tree.tree_mask, tree.parent_node, tree.depth,
                           torch.randint(-2, n + 2, (B, n), generator=g),
                           torch.randint(-2, n + 2, (B, n), generator=g), tree.retrive_index,
                           torch.rand(B, n, generator=g) < 0.8)
            pred = torch.randint(0, V, (B, n), generator=g)
            lens += _check_verify(bad, pred, S).accept_length.tolist()
            _check_verify(bad, pred, S + 2)
    assert 1 in lens and max(lens) >= min(3, S + 1, n)
    if n > 1:
        assert dropped > 0  # the invalid-tree paths were hit
