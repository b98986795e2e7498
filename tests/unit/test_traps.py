"""Single-process checks of the traps: NaN propagation in the
reference kernel, strict option types, the mask fingerprint, the light --help, the demo's backend
check, CommStats.sent_by_op, autocast, double backward."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import burstattn
from burstattn.kernels import get_kernel

ROOT = Path(burstattn.__file__).parents[1]


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_reference_kernel_nan_in_nan_out(where):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    {"q": q, "k": k, "v": v}[where][0, 0, 3, 5] = float("nan")
    out, _ = get_kernel("reference").forward(q, k, v, 0.25, False)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25)
    assert torch.equal(out.isnan(), want.isnan()) and out.isnan().any()
    # the masked-row path is still defined: a causal row 0 sees key 0 only, no NaN from -inf - -inf
    clean = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    assert not get_kernel("reference").forward(clean, clean, clean, 1.0, True)[0].isnan().any()


def test_nan_through_burst_attn_func():
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float64) for _ in range(3))  # float64: backend auto = reference
    k[0, 6, 1, 0] = float("nan")
    out = burstattn.burst_attn_func(q, k, v, causal=True)
    assert out[0, 6:, 1].isnan().all() and not out[0, :6].isnan().any() and not out[0, :, 0].isnan().any()


@pytest.mark.parametrize("bad, kind, words", [
    (dict(causal="False"), TypeError, ["causal", "bool", "str"]),
    (dict(causal=1), TypeError, ["causal", "bool", "int"]),
    (dict(softmax_scale=True), TypeError, ["softmax_scale", "real number", "bool"]),
    (dict(softmax_scale="0.3"), TypeError, ["softmax_scale", "str"]),
    (dict(softmax_scale=torch.tensor([0.3])), TypeError, ["softmax_scale"]),
    (dict(softmax_scale=-1.0), ValueError, ["softmax_scale", "positive"]),
])
@pytest.mark.parametrize("strategy", [None, "burst", "ulysses", "rsa"])
def test_strict_option_types(bad, kind, words, strategy):
    q = k = v = torch.randn(1, 8, 2, 16)
    with pytest.raises(kind) as info:
        if strategy is None:
            burstattn.burst_attn_func(q, k, v, **bad)
        else:
            burstattn.attention(q, k, v, strategy=strategy, **bad)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("scale", [np.float32(0.3), np.float64(0.3), torch.tensor(0.3), torch.tensor(0.3).double(), 1])
def test_real_scales_accepted(scale):
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    got = burstattn.burst_attn_func(q, k, v, softmax_scale=scale)
    want = burstattn.burst_attn_func(q, k, v, softmax_scale=float(scale))
    assert torch.equal(got, want)


def test_mask_fingerprint_is_the_values():
    from burstattn.masks import AttnMask

    def prefix(n):
        return lambda qp, kp: kp < n

    a, b, a2 = AttnMask(mask_mod=prefix(8)), AttnMask(mask_mod=prefix(40)), AttnMask(mask_mod=prefix(8))
    assert a.fingerprint(64) != b.fingerprint(64)  # same qualified name, different mask
    assert a.fingerprint(64) == a2.fingerprint(64)  # different objects, same mask
    assert a.fingerprint(4096) != b.fingerprint(4096)


def test_help_without_torch_and_every_command_listed():
    probe = ("import sys\nfrom burstattn.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("NO-TORCH") and "demo" in res.stdout and "bench" in res.stdout
    from burstattn.cli import COMMANDS, build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted(COMMANDS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_demo_sdpa_on_cpu_is_one_line():
    from burstattn.cli.demo_run import DemoConfig, config_error

    err = config_error(DemoConfig(world_size=2, seq_len=512, backend="sdpa"))
    assert err and "--backend sdpa" in err and "cpu_flash" in err and "Traceback" not in err


def test_sent_by_op():
    stats = burstattn.CommStats()
    stats.record("forward", "kv", 10, 10)
    stats.record("forward", "kv", 5, 5)
    stats.record("backward", "dq", 3, 3)
    assert stats.sent_by_op() == {("backward", "dq"): 3, ("forward", "kv"): 15}
    assert stats.sent_by_op("str") == {"backward/dq": 3, "forward/kv": 15}


@pytest.mark.parametrize("strategy", ["burst", "ring", "rsa", "ulysses", "allgather", "usp", "tp"])
def test_autocast_is_one_behaviour(strategy):
    """Under autocast every strategy computes in its inputs' dtype and returns it (as without)."""
    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
    opts = dict(ulysses_degree=1, ring_degree=1) if strategy == "usp" else {}
    want = burstattn.attention(q, k, v, strategy=strategy, causal=True, **opts)
    (gq,) = torch.autograd.grad(want.sum(), q)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = burstattn.attention(q, k, v, strategy=strategy, causal=True, **opts)
        (gq2,) = torch.autograd.grad(got.sum(), q)
    assert got.dtype == torch.float32 and torch.equal(got, want) and torch.equal(gq, gq2)


@pytest.mark.parametrize("strategy", ["burst", "rsa", "ulysses", "allgather", "tp"])
def test_double_backward_refused_every_strategy(strategy):
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = burstattn.attention(q, k, v, strategy=strategy, backend="reference")
    with pytest.raises(RuntimeError, match="second-order gradients"):
        (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
        g.sum().backward()


def test_burst_attention_module_takes_every_keyword():
    import inspect

    from burstattn.call.options import RARE_KEYWORDS

    fn = set(inspect.signature(burstattn.burst_attn_func).parameters) - {"q", "k", "v"}
    mod = set(inspect.signature(burstattn.BurstAttention).parameters)
    assert fn == mod
    from burstattn.masks.spec import MaskKeywords

    # the common keywords on burst_attn_func, the rare ones on their one definition (BurstOptions, MaskKeywords)
    doc = burstattn.burst_attn_func.__doc__ + burstattn.BurstOptions.__doc__ + MaskKeywords.__doc__
    documented = (fn - {"rare"}) | set(RARE_KEYWORDS)
    assert all(f"{name}:" in doc for name in documented), [n for n in documented if f"{n}:" not in doc]
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    out, lse = burstattn.BurstAttention(causal=True, return_lse=True)(q, k, v)
    assert lse.shape == (1, 2, 8)


def test_layout_none_is_zigzag_everywhere():
    from burstattn.strategies import STRATEGIES

    assert {s.default_layout for s in STRATEGIES.values()} == {"zigzag"}
    import inspect
    assert inspect.signature(burstattn.shard_sequence).parameters["layout"].default == "zigzag"


@pytest.mark.parametrize("kind", ["window", "mask", "partition"])
def test_compile_fullgraph_with_data_masks(kind):
    """Masks that are data (a window, a prebuilt AttnMask, a Partition) compile into the op's arguments."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 16, 2, 8, requires_grad=True) for _ in range(3))
    kw = {"window": dict(window=(4, 0)), "mask": dict(mask=burstattn.AttnMask(cu_seqlens=[0, 5, 16])),
          "partition": dict(layout=burstattn.document_partition([0, 5, 16], 1))}[kind]

    def fn(q, k, v):
        return burstattn.burst_attn_func(q, k, v, causal=True, **kw)

    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    (gq,) = torch.autograd.grad(got.sum(), q)
    want = fn(q, k, v)
    (wq,) = torch.autograd.grad(want.sum(), q)
    assert torch.equal(got, want) and torch.equal(gq, wq)
