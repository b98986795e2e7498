"""Pure pieces of training: degrees, positions, labels, the loss split, data, configs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from burstattn.layouts.named import local_positions
from burstattn.config import IGNORE_INDEX
from burstattn.parallel import ParallelDims, resolve_dims, shard_positions, sharded_loss, shift_labels
from burstattn.train import FileData, PasskeyData, TrainConfig, decode, load_config
from burstattn.train.job import lr_lambda


def test_resolve_dims():
    assert resolve_dims(4, "burst") == ParallelDims(1, 4, 1)
    assert resolve_dims(4, "tp-v3") == ParallelDims(1, 1, 4)
    assert resolve_dims(8, "burst", dp=2, tp=2) == ParallelDims(2, 2, 2)
    assert resolve_dims(4, "tp-v1", cp=2) == ParallelDims(1, 2, 2)
    assert ParallelDims(2, 2, 2).coords(5) == (1, 0, 1)
    for bad, match in ((dict(dp=3), "divisible"), (dict(cp=2, tp=4), "must equal"), (dict(dp=0), "positive")):
        with pytest.raises(ValueError, match=match):
            resolve_dims(4, "burst", **bad)
    with pytest.raises(ValueError, match="strategy"):
        resolve_dims(2, "megatron")


def test_shard_positions_cover_the_sequence_once():
    for strategy, layout, u in (("burst", "zigzag", 1), ("ring", "contiguous", 1), ("usp", "zigzag", 2),
                                ("ulysses", "striped", 1)):
        parts = [shard_positions(32, strategy=strategy, layout=layout, cp_rank=r, cp_size=4, ulysses_degree=u)
                 for r in range(4)]
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(32))
        if strategy != "usp":
            assert all(torch.equal(p, local_positions(32, r, 4, layout)) for r, p in enumerate(parts))


def test_global_loss_is_the_sum_of_the_shards():
    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (2, 12))
    logits = torch.randn(2, 12, 11, dtype=torch.float64)
    labels = shift_labels(tokens)
    assert torch.equal(labels[:, :-1], tokens[:, 1:]) and (labels[:, -1] == IGNORE_INDEX).all()
    whole = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    total = sum(sharded_loss(logits[:, p], labels[:, p], 2 * 11) for p in (local_positions(12, r, 3, "zigzag")
                                                                           for r in range(3)))
    assert torch.allclose(total, whole)


def test_passkey_is_deterministic_and_answerable():
    a, b = PasskeyData(7, 3, 160), PasskeyData(7, 3, 160)
    batch = a.batch(5)
    assert torch.equal(batch.tokens, b.batch(5).tokens) and not torch.equal(batch.tokens, a.batch(6).tokens)
    assert batch.tokens.shape == (3, 160) and batch.answer.sum() == 3 * 4
    for row, answer in zip(batch.tokens, batch.answer):
        text = decode(row)
        key = decode(row[answer.nonzero().squeeze(1) + 1])
        assert text.endswith("#" + key) and text.count("#" + key) == 2
    with pytest.raises(ValueError, match="seq_len"):
        PasskeyData(0, 1, 32)


def test_file_data(tmp_path):
    np.arange(300, dtype=np.uint16).tofile(tmp_path / "t.bin")
    np.arange(300, dtype=np.uint32).tofile(tmp_path / "t.u32")
    (tmp_path / "t.txt").write_text("héllo wörld " * 20)
    for name, fmt in (("t.bin", "uint16"), ("t.u32", "uint32"), ("t.txt", "text")):
        data = FileData(str(tmp_path / name), "auto", 0, 2, 64)
        assert data.format == fmt
        tokens = data.batch(3).tokens
        assert tokens.shape == (2, 64) and torch.equal(tokens, FileData(str(tmp_path / name), fmt, 0, 2, 64).batch(3).tokens)
        if fmt != "text":
            assert torch.equal(tokens[:, 1:] - tokens[:, :-1], torch.ones(2, 63, dtype=torch.int64))
    with pytest.raises(ValueError, match="no such file"):
        FileData(str(tmp_path / "nope"), "auto", 0, 1, 8)
    with pytest.raises(ValueError, match="fewer than"):
        FileData(str(tmp_path / "t.bin"), "auto", 0, 1, 1000)


def test_config_files(tmp_path):
    cfg = load_config("configs/train/passkey-tiny.toml", steps=5)
    assert cfg.model == "tiny" and cfg.steps == 5
    (tmp_path / "bad.toml").write_text("[train]\nmodle = 'tiny'\n")
    with pytest.raises(ValueError, match="modle"):
        load_config(tmp_path / "bad.toml")
    with pytest.raises(ValueError, match="resume"):
        TrainConfig(resume=True)
    with pytest.raises(ValueError, match="targets must be one of"):
        TrainConfig(targets="digits")
    with pytest.raises(ValueError, match="passkey"):
        TrainConfig(targets="answer", data="corpus.bin")
    f = lr_lambda(TrainConfig(steps=100, warmup=10, min_lr_ratio=0.1))
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(100) == pytest.approx(0.1)


def test_train_bench_points_and_report():
    """`bench train`'s plan of points (the sweep, then the modes; no sweep with no strategies) and its
    Markdown: the tables, the burst / contender and remat / full ratios, the emulated cluster's links."""
    import json
    from dataclasses import asdict

    from bench.train import TrainBenchConfig, config_from_dict, points
    from bench.train_report import markdown
    from bench.cluster.spec import Link

    cfg = TrainBenchConfig(seq_lens=(1024, 2048), strategies=("burst", "tp-v3"), fsdp=(False, True))
    pts = points(cfg)
    assert len(pts) == 2 * 2 * 2 + 2 * 3 and {p["seq_len"] for p in pts if p["suite"] == "modes"} == {2048}
    assert [p["suite"] for p in points(TrainBenchConfig(strategies=()))] == ["modes"] * 6
    assert config_from_dict(json.loads(json.dumps(asdict(cfg)))) == cfg  # the cluster worker's round trip

    def rec(strategy, fsdp, n, seconds, peak, suite="sweep", mode="none"):
        return dict(strategy=strategy, fsdp=fsdp, seq_len=n, suite=suite, checkpointing=mode, median_s=seconds,
                    tokens_per_s=n / seconds, peak_bytes_per_rank=[peak, peak // 2])
    mib = 2**20
    doc = dict(config=dict(model="small", batch=1, world_size=4, threads=1, repeats=3, warmup=1),
               spec=dict(nodes=2, ranks_per_node=2), links=dict(inter=Link(4.58e6, 27.3).describe(),
                                                                intra=Link(2.2e6).describe()),
               local_flops=55e9, cluster="a100-pcie-roce",
               records=[rec("burst", False, 4096, 2.0, 100 * mib), rec("burst", True, 4096, 2.5, 110 * mib),
                        rec("tp-v3", False, 4096, 4.0, 150 * mib),
                        rec("burst", False, 4096, 3.0, 90 * mib, "modes", "full"),
                        rec("burst", False, 4096, 2.0, 95 * mib, "modes", "remat")])
    text = markdown(doc)
    assert "inter-node link 4.58 MB/s, 27.3 ms, intra-node 2.2 MB/s" in text
    assert "burst / tp-v3 tokens/s = 2.00x" in text and "peak memory per rank = 0.73x" in text
    assert "| burst+fsdp | 1638 | 110 |" in text and "remat / full tokens/s = 1.50x" in text
    assert "| contender |  |" not in markdown(dict(doc, records=doc["records"][3:]))  # modes only: no empty table
