"""The plan memo (``engine.run.PLANS``): a ring step's plan is a pure function of the positions and the
layout, built once per shape and reused by every layer and by the forward, recomputation and backward;
and the float32 tiles and row chunks sized by bytes (``kernels.base.chunk_rows``)."""
from __future__ import annotations

import torch

import burstattn.engine.run as run
from burstattn.comm.host import LruCache
from burstattn.kernels.base import ROW_CHUNK, chunk_rows, row_dot
from burstattn.layouts.named import local_positions


def counting_builds(monkeypatch) -> list:
    """A fresh memo and a log of the plans actually built."""
    built: list = []
    make = run.make_plan

    def counted(*args, **kwargs):
        built.append(kwargs["travelling"])
        return make(*args, **kwargs)

    monkeypatch.setattr(run, "PLANS", LruCache(64))
    monkeypatch.setattr(run, "make_plan", counted)
    return built


def _positions(seq: int, world: int) -> list:
    return [local_positions(seq, r, world, "zigzag") for r in range(world)]


def test_equal_positions_reuse_the_plan(monkeypatch):
    built = counting_builds(monkeypatch)
    a = run.build_plan(1, 4, positions=_positions(64, 4), causal=True, travelling="kv")
    b = run.build_plan(1, 4, positions=_positions(64, 4), causal=True, travelling="kv")  # new tensors, same values
    assert a is b and built == ["kv"]
    assert run.build_plan(1, 4, positions=_positions(64, 4), causal=True, travelling="q") is not a
    assert run.build_plan(1, 4, positions=_positions(128, 4), causal=True, travelling="kv") is not a
    assert run.build_plan(2, 4, positions=_positions(64, 4), causal=True, travelling="kv") is not a
    assert built == ["kv", "q", "kv", "kv"]
    fresh = run.make_plan(1, 4, positions=_positions(64, 4), causal=True, travelling="kv")
    assert fresh == a  # the memo returns what a build returns


def test_row_chunks_hold_a_byte_budget():
    assert chunk_rows(1) == (1 << 23) and chunk_rows(4 * 128) == 16384 and chunk_rows(1 << 30) == ROW_CHUNK
    a, b = torch.randn(1, 2, 3000, 8, dtype=torch.bfloat16), torch.randn(1, 2, 3000, 8, dtype=torch.bfloat16)
    want = (a.float() * b.float()).sum(-1)
    assert torch.allclose(row_dot(a, b, torch.float32), want, rtol=1e-6, atol=1e-6)



def test_the_call_path_keeps_its_plans_in_the_one_memo(monkeypatch):
    """The call path (which knows a pass's plan from shapes and layouts, before any positions) and
    ``build_plan`` (from positions) share ``engine.run.PLANS``: a repeated pass builds nothing, and a
    fresh memo forgets both."""
    import burstattn.call.engine_adapter as adapter
    from burstattn.call.call import Call
    from burstattn.comm.groups import GroupContext

    assert not [n for n, v in vars(adapter).items() if isinstance(v, LruCache)]  # no second memo of plans
    built = counting_builds(monkeypatch)
    q = torch.randn(1, 8, 2, 4, dtype=torch.float64)
    cfg = Call(causal=True, backend="reference", where=GroupContext(None, 1, 4))
    plans = [adapter.engine_pass(cfg.where, cfg, q, q, q, "kv", None, 0.5)[0] for _ in range(2)]
    assert plans[0] is plans[1] and built == ["kv"]
    assert sorted(key[0] for key in run.PLANS.entries) == ["pass", "positions"]
