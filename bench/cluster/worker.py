"""What every rank runs under ``torchrun`` on an emulated cluster: ``python -m bench.cluster.worker
TASK --out DIR --config JSON``. Each rank writes ``DIR/rank{r}.json``.

Tasks:

* ``check``: one burst forward + backward on a small sequence, exact against the float64 dense
  reference (every rank computes it for the full sequence), bytes from ``comm_stats()`` and from this
  node's interface counters (``btnet0``: inter-node, ``lo``: intra-node) around the call.
* ``hold``: burst forward + backward in a loop until a call fails (a cut link, a killed node) or
  ``seconds`` pass; records the error type, message and when it came.
* ``grid``: for each strategy, a correctness check and timed forward / forward + backward calls,
  with bytes per phase and the interface counters (:mod:`bench.cluster.bench`).
* ``infer``: first-token latency of the sharded prefill per strategy and prompt length
  (:mod:`bench.cluster.infer_bench`).
* ``train``: training steps per strategy, tokens/s and peak memory per rank
  (:mod:`bench.cluster.train_bench`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from bench.cluster.netns import iface_tx


def _inputs(cfg: dict, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    b, n, hq, hkv, d = cfg["batch"], cfg["seq_len"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    return tuple(torch.randn(s, generator=gen) for s in ((b, n, hq, d), (b, n, hkv, d), (b, n, hkv, d), (b, n, hq, d)))


def task_check(cfg: dict) -> dict:
    import burstattn
    from burstattn.testing.oracle import exact_attention

    q, k, v, dout = _inputs(cfg)
    layout = cfg.get("layout", "zigzag")
    shards = [burstattn.shard_sequence(x, layout=layout).detach().clone().requires_grad_(i < 3)
              for i, x in enumerate((q, k, v, dout))]
    dist.barrier()
    before = iface_tx()
    with burstattn.comm_stats() as stats:
        out = burstattn.burst_attn_func(*shards[:3], causal=cfg["causal"], layout=layout, backend="auto")
        out.backward(shards[3])
    dist.barrier()
    after = iface_tx()
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref, _ = exact_attention(q64, k64, v64, causal=cfg["causal"])
    ref.backward(dout.double())
    errs = {}
    for name, got, want in (("out", out, ref), ("dq", shards[0].grad, q64.grad), ("dk", shards[1].grad, k64.grad),
                            ("dv", shards[2].grad, v64.grad)):
        w = burstattn.shard_sequence(want.detach(), layout=layout)
        errs[name] = float((got.double() - w).norm() / w.norm())
    return dict(errors=errs, sent=stats.sent(), sent_by_phase={ph: stats.sent(phase=ph) for ph in ("forward", "backward")},
                iface={kind: after[kind] - before[kind] for kind in after})


def task_hold(cfg: dict) -> dict:
    import burstattn

    q, k, v, dout = (burstattn.shard_sequence(x).detach().clone().requires_grad_(i < 3)
                     for i, x in enumerate(_inputs(cfg)))
    start, calls = time.time(), 0
    Path(cfg["ready_dir"]).mkdir(parents=True, exist_ok=True)
    (Path(cfg["ready_dir"]) / f"rank{dist.get_rank()}").write_text(str(start))
    try:
        while time.time() - start < cfg["seconds"]:
            out = burstattn.burst_attn_func(q, k, v, causal=True)
            out.backward(dout)
            calls += 1
    except Exception as e:  # the point of the task: report how the failure surfaced
        return dict(error_type=type(e).__name__, message=str(e)[:2000], failed_at=time.time(), calls=calls)
    return dict(error_type=None, calls=calls, failed_at=None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster.worker")
    p.add_argument("task", choices=["check", "hold", "grid", "infer", "train"])
    p.add_argument("--out", required=True)
    p.add_argument("--config", default="{}")
    ns = p.parse_args(argv)
    cfg = json.loads(ns.config)
    torch.set_num_threads(int(cfg.get("threads", 1)))
    timeout = datetime.timedelta(seconds=float(cfg.get("pg_timeout_s", 60)))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    out_dir = Path(ns.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        if ns.task == "grid":
            from bench.cluster.bench import task_grid
            result = task_grid(cfg)
        elif ns.task == "infer":
            from bench.cluster.infer_bench import task_infer
            result = task_infer(cfg)
        elif ns.task == "train":
            from bench.cluster.train_bench import task_train
            result = task_train(cfg)
        else:
            result = {"check": task_check, "hold": task_hold}[ns.task](cfg)
        result.update(rank=rank, world_size=dist.get_world_size(), ok=True)
    except Exception as e:
        result = dict(rank=rank, ok=False, error_type=type(e).__name__, message=str(e)[:2000],
                      traceback=traceback.format_exc()[-4000:], failed_at=time.time())
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if result.get("ok") and result.get("error_type") is None:
        dist.destroy_process_group()
        return 0
    # after a failure the process group may hold transfers that will never complete: leave at once
    # instead of waiting in its destructor
    os._exit(1)


if __name__ == "__main__":
    raise SystemExit(main())
