"""Host memory as a GPU job holds it, and one headroom for every answer.

* Pinned host memory: PyTorch's pinned allocator rounds each block up to a power of two; the library's host
  copy of a storage is power-of-two pieces (``models.offload.host_pieces``), restored exactly, and the planner
  counts those pieces tensor by tensor (``sim.activations.offloaded_tensors``) and FSDP2's pinned shards as
  power-of-two blocks.
* A node's host memory, less a reserve per process, is shared by the GPUs the job uses on it.
* Every plan leaves ``HEADROOM`` of the device memory free: the ranking, ``--max-seq-len`` on 1 and on 8 GPUs,
  and its ``--verify``.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from burstattn.models.config import preset as model_preset
from burstattn.models.offload import _Handle, _HostCopy, host_pieces, pinned_bytes, pow2_bytes
from burstattn.sim.activations import ActivationShape, head_kept, layer_kept, offloaded_tensors
from burstattn.sim.hardware import preset
from burstattn.sim.memory import HEADROOM, HOST_RESERVE, Memory
from burstattn.sim.offload import pinned_state_bytes
from burstattn.sim.planner import max_seq_len
from burstattn.sim.step import SimConfig, host_capacity, memory_model

GIB = 2**30
H100 = preset("h100-nvlink-ib")
L3 = model_preset("llama3-8b")


def test_pinned_blocks_and_pieces():
    assert [pow2_bytes(n) for n in (0, 1, 4096, 4097, int(6.4 * GIB))] == [0, 1, 4096, 8192, 8 * GIB]
    layer_input = 6.4 * GIB
    pieces = host_pieces(layer_input)
    assert all(p & (p - 1) == 0 for p in pieces) and len(pieces) <= 8
    assert layer_input <= pinned_bytes(layer_input) <= layer_input * 1.004  # 8 GiB as one pinned block
    assert host_pieces(0) == [] and host_pieces(10) == [4096] and pinned_bytes(12288) == 12288


@pytest.mark.parametrize("view", ["whole", "rows", "transposed"])
def test_a_copy_in_pieces_restores_every_view(view):
    x = torch.arange(6 * 1000 * 7, dtype=torch.float32).reshape(6, 1000, 7)
    storage = x.untyped_storage()
    flat, pieces, start = x.reshape(-1), [], 0
    for n in host_pieces(storage.nbytes()):
        piece = torch.zeros(n // 4)
        m = min(piece.numel(), flat.numel() - start)
        piece[:m] = flat[start:start + m]
        pieces.append(piece)
        start += m
    assert len(pieces) > 1
    t = {"whole": x, "rows": x[:, 300:700], "transposed": x.transpose(1, 2)}[view]
    handle = _Handle(_HostCopy(pieces, None, StorageWeakRef(storage)), t.size(), t.stride(), t.storage_offset(),
                     torch.device("meta"))
    # restore() gathers on the handle's device; a CPU stands in for the GPU here
    handle = dataclasses.replace(handle, device=torch.device("cpu"))
    assert torch.equal(handle.restore(), t)


@pytest.mark.parametrize("ckpt,offload,mlp_chunk,loss_chunk,fused", [
    ("full", "inputs", 4096, 256, False), ("remat", "all", 4096, 256, False), ("none", "all", 0, 0, False),
    ("none", "all", 4096, 512, True), ("full", "all", 4096, 0, False)])
def test_offloaded_tensors_are_what_is_kept(ckpt, offload, mlp_chunk, loss_chunk, fused):
    s = ActivationShape(rows=12345, attn_rows=12345, e=2)
    tensors = offloaded_tensors(L3, s, ckpt, offload, 1.0, True, mlp_chunk, loss_chunk, fused)
    kept = L3.n_layers * layer_kept(L3, s, ckpt, 1.0, True, mlp_chunk) + head_kept(L3, s, loss_chunk, fused)
    if offload == "all":
        assert sum(tensors) == pytest.approx(kept)
    else:
        assert len(tensors) == L3.n_layers + 1 and sum(tensors) <= kept


def test_planner_counts_host_memory_as_pinned():
    cfg = SimConfig(L3, 6 << 20, H100, "burst", cp=8, checkpointing="full", fsdp=True, mlp_chunk=65536,
                    loss_chunk=32768, offload="inputs", offload_optimizer=True)
    m = memory_model(cfg)
    shard = cfg.seq_len // 8 * L3.dim * 2  # one layer's input on one rank: 6 GiB
    inputs = (L3.n_layers + 1) * pinned_bytes(shard)
    assert m.host == pytest.approx(inputs + pinned_state_bytes(L3, tp=1, shards=8))
    assert m.host_copied == pytest.approx((L3.n_layers + 1) * shard + 16 * L3.num_params() / 8)
    assert m.host < 1.02 * m.host_copied  # as 8 GiB blocks it would be 33 x 8 GiB, over the host's 216.8 GiB
    assert 33 * pow2_bytes(shard) > host_capacity(H100, 8)


def test_host_of_a_node_shared_with_a_reserve_per_process():
    assert host_capacity(H100, 8) == pytest.approx(2e12 / 8 - HOST_RESERVE)
    assert host_capacity(H100, 1) == pytest.approx(2e12 - HOST_RESERVE)  # a one-GPU job has the node
    assert host_capacity(H100, 32) == host_capacity(H100, 8)  # a node's 8 GPUs share it


def test_one_headroom_everywhere():
    m = Memory(params=0, grads=0, optimizer=0, activations=0.95 * 80e9, attention=0, kv_cache=0, capacity=80e9)
    assert not m.fits and m.usable == pytest.approx((1 - HEADROOM) * 80e9)
    assert dataclasses.replace(m, activations=0.89 * 80e9).fits
    for gpus in (1, 8):  # the 1-GPU answer and the 8-GPU one keep the same headroom
        best = max_seq_len(L3, gpus, H100, labels=("burst",))["burst"]
        assert 0.85 * 80e9 < best["peak_memory_bytes"] <= (1 - HEADROOM) * 80e9, (gpus, best)
    from burstattn.cli import verify_len

    assert verify_len.HEADROOM is HEADROOM
