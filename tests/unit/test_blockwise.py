"""The blockwise transformer at world 1: the chunked MLP and loss equal the whole-sequence model
(float64), the lean remat keeps exactly the layer inputs, attention outputs and LSEs and never
reruns the attention op, the offload hooks round-trip, and bad options raise naming the flag."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from burstattn.config import IGNORE_INDEX
from burstattn.meter.memory import measure_peak
from burstattn.models import AttnCall, HostOffload, Llama, LlamaConfig, auto_chunks, chunk_bounds, preset
from burstattn.models.blockwise import take_rows
from burstattn.models.offload import offload_problem, offloaded_bytes
from burstattn.train import TrainConfig

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
B, N = 2, 24


def test_chunk_bounds_and_rows():
    assert chunk_bounds(10, 0) == [(0, 10)] and chunk_bounds(10, 10) == [(0, 10)] and chunk_bounds(10, 64) == [(0, 10)]
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(3, 1) == [(0, 1), (1, 2), (2, 3)]
    t = torch.arange(12).view(1, 12)
    assert take_rows(t, 1, 12, 3, 5).tolist() == [[3, 4]]
    # 3 shards of 4 rows: local rows [1, 3) of every shard
    assert take_rows(t, 3, 4, 1, 3).tolist() == [[1, 2, 5, 6, 9, 10]]


def test_auto_chunks():
    assert auto_chunks(256, 256, 4096) == (0, 0)  # short: whole
    assert auto_chunks(256, 256, 65536) == (2048, 0)  # small's 256-token vocabulary: logits stay whole
    assert auto_chunks(256, 8192, 16384) == (2048, 2048)  # small-l3
    assert auto_chunks(4096, 128256, 1 << 19) == (4096, 256)  # llama3-8b
    assert auto_chunks(4096, 128256, 256) == (0, 0)


def _model(**over):
    ck = over.pop("checkpointing", "none")
    off = over.pop("offload", "none")
    torch.manual_seed(1)
    model = Llama(CFG.with_overrides(**over), attn=AttnCall(layout="contiguous", options=dict(backend="reference")),
                  checkpointing=ck, offload=off).double()
    model.offload_copies_on_cpu = True  # the offload path copies on CPU too, to exercise it
    return model


def _batch():
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, CFG.vocab_size, (B, N), generator=g)
    labels = torch.randint(0, CFG.vocab_size, (B, N), generator=g)
    labels[0, :5] = IGNORE_INDEX
    answer = torch.zeros(B, N, dtype=torch.bool)
    answer[:, -4:] = True
    return tokens, labels, answer, int((labels != IGNORE_INDEX).sum())


def _run(**over):
    model = _model(**over)
    tokens, labels, answer, total = _batch()
    out = model(tokens, torch.arange(N), labels=labels, total_targets=total, answer=answer)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


OPTIONS = [dict(), dict(mlp_chunk=5), dict(mlp_chunk=1), dict(loss_chunk=7), dict(loss_chunk=1),
           dict(offload="inputs"), dict(offload="all"), dict(mlp_chunk=5, loss_chunk=7, offload="all"),
           dict(mlp_chunk=8, loss_chunk=24, tie_embeddings=True)]


@pytest.mark.parametrize("mode,opts", list(itertools.product(("none", "full", "remat"), OPTIONS)),
                         ids=lambda x: str(x))
def test_options_equal_the_whole_model(mode, opts):
    """Every option, alone and together, under every checkpointing mode: loss, answer statistics
    and gradients equal the unchunked model's (float64)."""
    tie = opts.get("tie_embeddings", False)
    ref, g0 = _run(tie_embeddings=tie)
    out, g = _run(checkpointing=mode, **opts)
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-12)
    assert out.answer_hits.item() == ref.answer_hits.item()
    assert out.answer_ce.item() == pytest.approx(ref.answer_ce.item(), rel=1e-12)
    for name, grad in g0.items():
        assert float((g[name] - grad).norm() / grad.norm()) < 1e-12, name


def test_blockwise_loss_is_the_logits_loss():
    """The blockwise loss equals cross-entropy of the logits the model still returns without labels."""
    model = _model(loss_chunk=5, mlp_chunk=3)
    tokens, labels, answer, total = _batch()
    logits = model(tokens, torch.arange(N))  # [B, N, V]
    assert logits.shape == (B, N, CFG.vocab_size)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                             reduction="sum") / total
    got = model(tokens, torch.arange(N), labels=labels, total_targets=total, answer=answer)
    assert got.loss.item() == pytest.approx(want.item(), rel=1e-12)
    hits = ((logits.argmax(-1) == labels) & answer).sum()
    assert got.answer_hits.item() == hits.item()
    with pytest.raises(ValueError, match="total_targets"):
        model(tokens, torch.arange(N), labels=labels)


class _OpCalls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.burstattn.attention_fwd.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mlp_chunk", [0, 5])
def test_lean_remat_keeps_inputs_outputs_lse_and_never_reruns_attention(mlp_chunk):
    """What a remat forward leaves allocated is exactly every layer's input, attention output and
    LSE plus the final hidden state (float64 bytes), and the attention op runs L times per step
    (2L with full checkpointing)."""
    tokens, labels, _, total = _batch()
    hd = CFG.dim // CFG.n_heads
    per_layer = B * N * (CFG.dim + CFG.n_heads * hd + CFG.n_heads) * 8  # x, out, lse (float64)
    kept_want = CFG.n_layers * per_layer + B * N * CFG.dim * 8  # + the final hidden state (loss chunks' input)
    for mode, calls_want in (("remat", CFG.n_layers), ("full", 2 * CFG.n_layers), ("none", CFG.n_layers)):
        model = _model(checkpointing=mode, mlp_chunk=mlp_chunk, loss_chunk=6)
        out, mem = measure_peak(lambda: model(tokens, torch.arange(N), labels=labels, total_targets=total))
        if mode == "remat":
            assert kept_want <= mem.end_bytes <= kept_want + 4096, (mem.end_bytes, kept_want)
        counter = _OpCalls()
        with counter:
            out.loss.backward()
        assert counter.calls == (CFG.n_layers if mode == "full" else 0), mode  # the backward reruns only under full
        assert calls_want == CFG.n_layers * (2 if mode == "full" else 1)


def test_host_offload_round_trip_and_views():
    off = HostOffload("inputs", copy_on_cpu=True)
    x0 = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    x = off.mark(x0 * 1)  # an activation (a leaf that requires grad is a weight: never offloaded)
    with off.hooks():
        y = (x.narrow(0, 0, 2) * 2).sum() + (x.narrow(0, 1, 2) @ w).sum() + (x * x).sum()
    assert off.bytes_on_host == x.numel() * 4  # one host copy of x's storage for all its views; w stays
    y.backward()
    assert torch.allclose(x0.grad, 2 * torch.ones(3, 8).index_fill(0, torch.tensor([2]), 0)
                          + torch.cat([torch.zeros(1, 8), w.sum(1).expand(2, 8)]) + 2 * x.detach())
    none = HostOffload("none")
    assert not none.active and none.pack(x) is x
    assert not HostOffload("all", copy_on_cpu=True).wants(w)  # a weight stays
    with pytest.raises(ValueError, match="offload"):
        HostOffload("disk")


def test_offload_stale_storage_is_not_reused():
    """A new tensor at a freed storage's address gets its own host copy."""
    off = HostOffload("all", copy_on_cpu=True)
    a = torch.full((1024,), 1.0)
    ha = off.pack(a)
    del a
    b = torch.full((1024,), 2.0)  # may land at the same address
    hb = off.pack(b)
    assert torch.equal(off.unpack(hb), b) and float(off.unpack(ha)[0]) == 1.0


def test_offload_needs_host_memory():
    mcfg = preset("llama3-8b")
    need = offloaded_bytes(mcfg, batch=1, rows=1 << 19, attn_rows=1 << 19, heads=32, checkpointing="remat",
                           mode="all", element_size=2)
    assert need == pytest.approx(33 * (1 << 19) * 4096 * 2 + 32 * (1 << 19) * 32 * (128 * 2 + 4))
    assert offload_problem("all", need, 2 * need) is None
    msg = offload_problem("all", need, need / 4)
    assert "--offload all" in msg and "GiB" in msg
    assert offload_problem("none", need, 0) is None


@pytest.mark.parametrize("field,value,match", [
    ("mlp_chunk", -1, "--mlp-chunk"), ("loss_chunk", 2.5, "--loss-chunk"), ("mlp_chunk", True, "--mlp-chunk"),
    ("offload", "disk", "--offload")])
def test_bad_options_name_the_flag(field, value, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{field: value})
    if field != "offload":
        with pytest.raises(ValueError, match=field):
            LlamaConfig(**{field: value})
    else:
        with pytest.raises(ValueError, match="offload"):
            Llama(CFG, offload=value)


def test_small_l3_preset():
    c = preset("small-l3")
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size) == (256, 4, 4, 1, 896, 8192)
    assert preset("small").vocab_size == 256


def test_simulator_names_the_same_offload_modes():
    from burstattn.models import OFFLOAD
    from burstattn.sim.names import OFFLOAD as SIM_OFFLOAD

    assert SIM_OFFLOAD == OFFLOAD


def test_train_config_names_the_same_offload_modes():
    from burstattn.models import OFFLOAD
    from burstattn.train.config import OFFLOAD as TRAIN_OFFLOAD

    assert TRAIN_OFFLOAD == OFFLOAD
