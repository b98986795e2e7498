"""The steps of one lent GPU's session (``bash scripts/cuda_session.sh``; issue 42 reads their JSON).

    python3 scripts/cuda_session.py --step NAME --out DIR      # one step on the GPU -> DIR/NAME.json
    python3 scripts/cuda_session.py --step all --dry --out DIR # every step on the CPU at tiny sizes

Steps (``STEPS``): ``env``; ``exact`` (world 1 and the emulated ring, P = 2, 4, 8: float32 against
float64, bf16 within flash-attn's rule); ``world1`` (``burst_attn_func`` against SDPA's best kernel,
bf16); ``per_rank`` (one rank's kernel calls of a world-P plan against SDPA over the same work);
``masks`` (window N/8, 8 documents, a local+global ``mask_mod`` against dense causal at 32K, world 1
and the emulated P = 4, and their exactness); ``hybrids`` (Gated DeltaNet and SSD at 32K);
``dryrun`` (the dry run against ``torch.cuda.max_memory_allocated``); ``calibrate`` (the device's
attention, matmul and memory rates). Every case is recorded as it finishes (a step cut by its
timeout keeps what it measured); a case that fails records its error and the next one runs. ``--dry``
builds every case's inputs at tiny sizes on the CPU and runs them once, so CI checks that the steps
parse, import and run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Ctx:
    """One step's run: the device, ``dry`` (CPU, tiny sizes), and its JSON record (written after every case)."""

    step: str
    out: str
    dry: bool
    rows: list = field(default_factory=list)
    started: float = field(default_factory=time.time)

    @property
    def dev(self) -> torch.device:
        return torch.device("cpu" if self.dry else "cuda")

    @property
    def device_type(self):
        """The device the steps' kernel policy is chosen for: the tensors' own on the GPU; ``"cuda"`` in a dry
        run, so the CPU runs the GPU's path (its kernels' plain-PyTorch stand-ins)."""
        return "cuda" if self.dry else None

    @property
    def low(self) -> torch.dtype:
        """The 16-bit dtype of the timed cases (bf16 on the GPU; on the CPU too, at tiny sizes)."""
        return torch.bfloat16

    def size(self, real, tiny):
        return tiny if self.dry else real

    def sync(self) -> None:
        if not self.dry:
            torch.cuda.synchronize()

    def record(self, **row) -> None:
        row.setdefault("seconds_since_start", round(time.time() - self.started, 2))
        self.rows.append(row)
        print(json.dumps(row, default=str)[:400], flush=True)
        self.write()

    def case(self, name: str, fn, **info) -> None:
        """Run one case ``fn() -> dict``; its result or its error becomes a row."""
        t0 = time.time()
        try:
            self.record(case=name, **info, **fn(), case_seconds=round(time.time() - t0, 3))
        except Exception as exc:  # noqa: BLE001 - recorded; the next case runs
            self.record(case=name, **info, error=f"{type(exc).__name__}: {exc}"[:600],
                        trace=traceback.format_exc()[-1500:])
            if not self.dry:
                torch.cuda.empty_cache()

    def write(self) -> None:
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, f"{self.step}.json"), "w") as f:
            json.dump(dict(step=self.step, dry=self.dry, torch=torch.__version__,
                           device=torch.cuda.get_device_name() if not self.dry else "cpu", rows=self.rows),
                      f, indent=1, default=str)


def timed(ctx: Ctx, arms: dict, repeats: int = 5, warmup: int = 2) -> dict:
    """Median seconds of each arm (``name -> fn()``), the arms alternated in every repeat."""
    repeats, warmup = ctx.size(repeats, 1), ctx.size(warmup, 0)
    for _ in range(warmup):
        for fn in arms.values():
            fn()
    ctx.sync()
    times: dict = {name: [] for name in arms}
    for _ in range(repeats):
        for name, fn in arms.items():
            ctx.sync()
            t0 = time.perf_counter()
            fn()
            ctx.sync()
            times[name].append(time.perf_counter() - t0)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def randn(ctx: Ctx, *shape, dtype=torch.float32, seed: int = 0, grad: bool = False) -> torch.Tensor:
    gen = torch.Generator(device=ctx.dev).manual_seed(seed)
    x = torch.randn(*shape, generator=gen, device=ctx.dev).to(dtype)
    return x.requires_grad_() if grad else x


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    keep = torch.isfinite(b)
    return float((a.detach().double() - b.detach().double())[keep].abs().max())


def attention_flops(n: int, hq: int, d: int, causal: bool, n_k: int = 0) -> float:
    """Forward + backward FLOPs of one attention (4 n N d H forward, 2.5x that backward)."""
    return 4 * n * (n_k or n) * d * hq * 3.5 * (0.5 if causal else 1.0)


def step_env(ctx: Ctx) -> None:
    import importlib.util

    from burstattn.kernels import available_backends

    def info():
        return dict(torch=torch.__version__, cuda=torch.version.cuda, device=str(ctx.dev),
                    name=torch.cuda.get_device_name() if not ctx.dry else "cpu",
                    backends=available_backends(ctx.dev),
                    flash_attn=importlib.util.find_spec("flash_attn") is not None,
                    fla=importlib.util.find_spec("fla") is not None,
                    transformers=importlib.util.find_spec("transformers") is not None)
    ctx.case("environment", info)


def steps() -> dict:
    from cuda_steps_attention import step_exact, step_masks, step_per_rank, step_world1
    from cuda_steps_other import step_calibrate, step_dryrun, step_hybrids

    return dict(env=step_env, exact=step_exact, world1=step_world1, per_rank=step_per_rank, masks=step_masks,
                hybrids=step_hybrids, dryrun=step_dryrun, calibrate=step_calibrate)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--step", required=True, help="a step name, or 'all'")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/cuda_session"))
    ap.add_argument("--dry", action="store_true", help="CPU, tiny sizes: check that every step runs")
    ns = ap.parse_args(argv)
    table = steps()
    names = list(table) if ns.step == "all" else [ns.step]
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown step {unknown}; steps: {list(table)} or 'all'")
    if not ns.dry and not torch.cuda.is_available():
        print("no CUDA device: run with --dry on a CPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    failed = []
    for name in names:
        ctx = Ctx(name, ns.out, ns.dry)
        try:
            table[name](ctx)
        except Exception as exc:  # noqa: BLE001 - a step's own setup failed: recorded, the next step runs
            ctx.record(case="step", error=f"{type(exc).__name__}: {exc}"[:600], trace=traceback.format_exc()[-1500:])
        ctx.write()
        failed += [f"{name}/{r.get('case')}" for r in ctx.rows if "error" in r]
    print(f"steps {names}: {len(failed)} failed cases {failed[:20]}", flush=True)
    return 1 if ns.dry and failed else 0


if __name__ == "__main__":
    sys.exit(main())
