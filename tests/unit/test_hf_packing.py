"""Pure pieces of the Hugging Face path: batch plans (packing, padding -> documents) and bench hf's data."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5")

from burstattn.hf.packing import plan_batch, rope_positions, shifted_labels  # noqa: E402


def test_plain_rows_stay_rows():
    ids = torch.zeros(3, 10, dtype=torch.long)
    plan, problem = plan_batch(ids, attention_mask=torch.ones(3, 10), position_ids=torch.arange(10)[None])
    assert problem is None and not plan.flattened and plan.rows == 3 and plan.cu_seqlens() is None
    assert plan.padded(4).row_len == 12


def test_packing_and_padding_become_documents():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    plan, _ = plan_batch(torch.zeros(1, 9, dtype=torch.long), position_ids=pos)
    assert plan.flattened and plan.cu_seqlens().tolist() == [0, 3, 5, 9]
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    plan, _ = plan_batch(torch.zeros(3, 5, dtype=torch.long), attention_mask=mask)
    # rows end to end; every pad run is its own document; padded to 16 for the layout
    assert plan.padded(8).cu_seqlens().tolist() == [0, 3, 5, 7, 10, 15, 16]
    labels = torch.arange(15).view(3, 5)
    shifted = shifted_labels(labels, plan.padded(8))[0].tolist()
    assert shifted[:5] == [1, 2, 3, -100, -100]  # pads predict nothing; the last real token the next label, as in HF
    assert shifted[5:10] == [-100, -100, 8, 9, -100] and shifted[15] == -100
    assert rope_positions(None, plan.padded(8))[0].tolist()[:6] == [0, 1, 2, 3, 4, 0]


def test_packing_with_padding():
    """A packed row right-padded to a fixed length: its documents plus the pad run."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 7, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0]])
    plan, _ = plan_batch(torch.zeros(1, 7, dtype=torch.long), attention_mask=mask, position_ids=pos)
    assert plan.cu_seqlens().tolist() == [0, 3, 5, 7]


@pytest.mark.parametrize("mask,expect", [([[1, 0, 1]], "zeros between real tokens"),
                                         ([[[1, 1, 1]]], "2-D padding mask")])
def test_refused_masks(mask, expect):
    plan, problem = plan_batch(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.tensor(mask))
    assert plan is None and expect in problem


def test_cu_seq_lens_checked():
    ids = torch.zeros(1, 6, dtype=torch.long)
    assert "differ" in plan_batch(ids, cu_seq_lens_q=[0, 2, 6], cu_seq_lens_k=[0, 3, 6])[1]
    assert "increase strictly" in plan_batch(ids, cu_seq_lens_q=[0, 2, 5])[1]
    plan, _ = plan_batch(ids, cu_seq_lens_q=torch.tensor([0, 2, 6]))
    assert plan.cu_seqlens().tolist() == [0, 2, 6]


def test_bench_hf_data_and_balance():
    from bench.hf import HfBenchConfig, doc_lengths, packed_rows, run_balance

    lengths = doc_lengths(4096, 200, seed=3)
    assert sum(lengths) == 4096 and min(lengths) >= 1 and lengths == doc_lengths(4096, 200, seed=3)
    cfg = HfBenchConfig(vocab=64, mean_doc=200, balance_seq_len=4096, balance_world_sizes=(2, 4), block_size=128)
    row = packed_rows(cfg, 512, 1)[0]
    assert row["input_ids"].shape == (512,) and int((row["position_ids"] == 0).sum()) == int((row["labels"] == -100).sum())
    rows = {(r["world_size"], r["layout"]): r for r in run_balance(cfg)[0]["rows"]}
    for p in (2, 4):  # the document partition evens out the exact causal work; zigzag does not
        assert rows[p, "documents"]["exact_max_over_mean"] < 1.02 < rows[p, "zigzag"]["exact_max_over_mean"]
