"""The device inputs of a scheduled batch on one stage (SGLang's ``ForwardBatch`` preparation): flat input_ids,
positions and out_cache_loc [T] int64 on the device, and the attention layout (:class:`ForwardContext`: qo_indptr,
per-request kv_indices from ``req_to_token``, and for verify the tree mask with the prefix lengths)."""
from __future__ import annotations

import torch

from .attention.backend import ForwardContext, h2d


def batch_inputs(batch, req_to_token: torch.Tensor, kv_pool, device: torch.device, tree=None,
                 lookahead: bool = False):
    """(input_ids [T], positions [T], ForwardContext) for ``batch`` (prefill chunks, decode or, with ``tree``,
    verify). ``lookahead`` (decode, overlap schedule): one step past the step in flight, whose token is not on the
    host yet (position seq_len + 1; the caller supplies the input ids from the device). Page tables stay on the
    host (the backend moves what it needs in one copy); ids, positions and out_cache_loc travel together in one
    pinned host-to-device copy."""
    if batch.kind == "verify":
        return verify_inputs(batch, req_to_token, kv_pool, device, tree)
    rt = req_to_token
    ids, pos, locs, kv, qo = [], [], [], [], [0]
    for i, r in enumerate(batch.reqs):
        if batch.kind == "prefill":
            st, en, _ = batch.chunks[i]
            ids.append(torch.tensor(r.fill_ids[st:en]))
            pos.append(torch.arange(st, en))
            locs.append(rt[r.row, st:en])
            kv.append(rt[r.row, :en])
        else:                                  # decode
            L = r.seq_len + (1 if lookahead else 0)
            ids.append(torch.tensor([r.root_token]))
            pos.append(torch.tensor([L]))
            locs.append(rt[r.row, L:L + 1])
            kv.append(rt[r.row, :L + 1])
        qo.append(qo[-1] + ids[-1].numel())
    ids_d, pos_d, loc_d = h2d(torch.stack([torch.cat(ids).long(), torch.cat(pos).long(), torch.cat(locs).long()]),
                              device)
    return ids_d, pos_d, ForwardContext(qo, kv, None, loc_d, kv_pool, batch.kind)


def verify_inputs(batch, req_to_token: torch.Tensor, kv_pool, device: torch.device, tree):
    """Verify inputs: ids/positions are the tree's (copied in one pinned copy with out_cache_loc when the tree is
    host data; used in place when it lives on the device, ``spec_device_tree``), page tables come from the host,
    and the masks stay as ``tree_mask`` [B, n, n] + prefix lengths: the backend expands them (``request_masks``) or
    the graph runner bit-packs them (``pack_verify_mask``: numpy on the host, Triton on the device) without building
    B host masks of n x (L + n)."""
    rt = req_to_token
    n = tree.candidates.shape[1]
    Ls = [r.seq_len for r in batch.reqs]
    locs = torch.cat([rt[r.row, L:L + n] for r, L in zip(batch.reqs, Ls)])
    kv = [rt[r.row, :L + n] for r, L in zip(batch.reqs, Ls)]
    if tree.candidates.device.type == "cpu":
        ids_d, pos_d, loc_d = h2d(torch.stack([tree.candidates.reshape(-1), tree.positions.reshape(-1), locs]), device)
    else:
        ids_d, pos_d, loc_d = tree.candidates.reshape(-1), tree.positions.reshape(-1), h2d(locs, device)
    ctx = ForwardContext(list(range(0, len(Ls) * n + 1, n)), kv, None, loc_d, kv_pool, "verify",
                         tree_mask=tree.tree_mask, prefix_lens=Ls)
    return ids_d, pos_d, ctx
