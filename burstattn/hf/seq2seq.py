"""Sequence-parallel batches for encoder-decoder models (T5Gemma): both sequences sharded.

The encoder's tokens and the decoder's tokens are two sequences of their own lengths; each is
split over the group with the same ``layout``. Under ``attn_implementation="burst"`` the encoder's
bidirectional self-attention, the decoder's causal self-attention and the decoder's
cross-attention to the encoder (queries of one sequence, keys of the other) then all run
sequence-parallel (:mod:`burstattn.hf.families`), and ``model(**batch).loss`` is the
single-process loss on every rank.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..comm.groups import group_context
from ..config import IGNORE_INDEX
from ..layouts.named import local_positions
from .batch import GlobalItemCount


def _ids(name: str, x) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.int64, torch.int32) or not x.shape[1]:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"shard_seq2seq_batch: {name} must be a non-empty integer tensor [batch, seq], got {shape}")


def shard_seq2seq_batch(input_ids: torch.Tensor, decoder_input_ids: torch.Tensor,
                        labels: Optional[torch.Tensor] = None, *, group: Optional[dist.ProcessGroup] = None,
                        layout: str = "zigzag") -> dict:
    """This rank's model kwargs for a full encoder-decoder batch (the same on every rank).

    Args:
        input_ids: the encoder's tokens ``[B, N_enc]``; ``N_enc`` must split over the group by
            ``layout`` (a multiple of ``2P`` for zigzag, ``P`` otherwise): a pad would be seen by the
            bidirectional encoder.
        decoder_input_ids: the decoder's tokens ``[B, N_dec]`` (already shifted right, as the model's
            own ``labels`` path does); right-padded to a multiple if needed (causal: no real token sees
            a pad).
        labels: ``[B, N_dec]`` targets aligned with ``decoder_input_ids`` (no further shift), ``-100``
            ignored.

    Returns ``input_ids``, ``position_ids``, ``decoder_input_ids``, ``decoder_position_ids`` (this rank's
    tokens and their GLOBAL positions) and, with labels, ``labels`` and ``num_items_in_batch`` (a
    :class:`~burstattn.hf.batch.GlobalItemCount`).
    """
    _ids("input_ids", input_ids)
    _ids("decoder_input_ids", decoder_input_ids)
    _, rank, world = group_context(group)
    unit = 2 * world if layout == "zigzag" else world
    b, n_enc = input_ids.shape
    if n_enc % unit:
        raise ValueError(f"shard_seq2seq_batch: the encoder's length {n_enc} must be a multiple of {unit} for layout "
                         f"{layout!r} over {world} ranks (a pad would be seen by the bidirectional encoder)")
    if decoder_input_ids.shape[0] != b:
        raise ValueError(f"shard_seq2seq_batch: decoder_input_ids has batch {decoder_input_ids.shape[0]}, input_ids {b}")
    n_dec = decoder_input_ids.shape[1]
    pad = -(-n_dec // unit) * unit - n_dec
    dec = torch.cat([decoder_input_ids, decoder_input_ids.new_zeros(b, pad)], 1) if pad else decoder_input_ids
    enc_pos = local_positions(n_enc, rank, world, layout).to(input_ids.device)
    dec_pos = local_positions(n_dec + pad, rank, world, layout).to(input_ids.device)
    batch = {"input_ids": input_ids[:, enc_pos], "position_ids": enc_pos.unsqueeze(0).expand(b, -1),
             "decoder_input_ids": dec[:, dec_pos], "decoder_position_ids": dec_pos.unsqueeze(0).expand(b, -1)}
    if labels is not None:
        _ids("labels", labels)
        if labels.shape != decoder_input_ids.shape:
            raise ValueError(f"shard_seq2seq_batch: labels {tuple(labels.shape)} must match decoder_input_ids "
                             f"{tuple(decoder_input_ids.shape)}")
        full = torch.cat([labels, labels.new_full((b, pad), IGNORE_INDEX)], 1) if pad else labels
        batch.update(labels=full[:, dec_pos].contiguous(),
                     num_items_in_batch=GlobalItemCount(int((full != IGNORE_INDEX).sum()), group, world))
    return batch
