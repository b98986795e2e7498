"""``burstattn train --dry-run``: one optimizer step of the real job, on one rank, with fake tensors.

The job is built by :func:`~burstattn.train.job.build_job` and stepped by
:func:`~burstattn.train.step.step_tensors`, the code ``burstattn train`` runs, inside
``FakeTensorMode`` (tensors with shapes and dtypes, no storage) over the fake process group
(``dist.init_process_group("fake", ...)``: collectives return at once), so any world size and
sequence length run on one CPU. PyTorch's memory trackers (``MemTracker``, ``FSDPMemTracker`` with
FSDP2) follow every allocation (:mod:`.dryrun_tracker`).

What is measured and what is not:

* Device: a CPU build cannot run a matmul on fake CUDA tensors, so the fake tensors are CPU
  tensors in the run's dtype. Their storage sizes are what the GPU's allocator would be asked
  for (without the CUDA caching allocator's rounding to 512 bytes: negligible at these sizes).
* The GPU's attention path: on a GPU a 16-bit ring step is one kernel call per head group in the inputs'
  own dtype (the kernel's own backward; partials accumulated in float32), while the CPU kernel of the fake
  tensors would take the engine's float32 tiles. :func:`as_on_a_gpu` sets ``grad_partials="kernel"`` for
  every strategy and context-parallel size, so the fake step makes one kernel call per step, block op and
  head group (``kernel_calls`` in the report).
* Kernel workspace: the local kernel is the CPU flash op, whose fake implementation allocates the outputs
  a GPU kernel returns (output, LSE; dQ, dK, dV). :class:`GpuKernel` adds what the modelled GPU backend
  (``kernel``: ``sdpa``, the default, or ``flash_attn``) allocates besides at each call, to what is alive
  then (:func:`burstattn.kernels.workspace.kernel_workspace`: flash-attn 2's float32 ``dq_accum`` and
  ``softmax_d``, the expanded dK/dV of grouped K/V heads, and the copies SDPA makes of row slices);
  ``workspace_bytes`` is the largest call's.
* Host state: with ``--offload-optimizer`` (FSDP2's ``CPUOffloadPolicy``) the sharded parameters,
  gradients and optimizer state are host memory on a GPU; here every fake tensor is a CPU tensor, so
  the tracker leaves those reference types out of the device's bytes and reports them as
  ``host_state_bytes`` (:data:`~burstattn.train.dryrun_tracker.OFFLOADED`).
* Host: saved activations offloaded to host memory (``--offload``) are copied, as on a GPU, to
  another device (``meta``: fake tensors there are not the tracked device's memory) and back when the
  backward unpacks them; ``host_bytes`` is the bytes of the offloaded storages
  (:class:`~burstattn.models.offload.HostOffload`).
* The step is a steady-state one (the optimizer state exists before it, as in
  :func:`bench.train_memory.probe_step`); the peak includes the parameters, gradients and
  optimizer state, and ``step_peak_bytes`` is the peak above what the step started with.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from .checks import check_config, check_parallel
from .config import TrainConfig
from .dryrun_tracker import CATEGORIES, OFFLOADED, PHASES, DryRunTracker, FSDPDryRunTracker

MAX_WORLD = 1024
DRY_STEP = 1  # the data of step 1: a steady-state step after the optimizer state exists


class DryRunError(RuntimeError):
    """The fake mode could not follow the step: one line naming the op and the module."""


def warm_optimizer(job) -> None:
    """Create AdamW's state with zero gradients (no parameter moves: zero weight decay, zero
    moments), so that a measured step does not include the state's first allocation."""
    for p in job.model.parameters():
        p.grad = torch.zeros_like(p)
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)


_CPU_FLASH_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_FLASH_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class GpuKernel:
    """The GPU kernel ``backend`` (:data:`~burstattn.kernels.workspace.GPU_BACKENDS`) in place of the CPU
    flash op that stands for it on the fake tensors: called with each dispatched op and its arguments, it
    returns the bytes the GPU kernel allocates beside that call's outputs (0 for any other op) and counts
    the calls (``calls``: forward and backward)."""

    def __init__(self, backend: str = "sdpa") -> None:
        from ..kernels.workspace import GPU_BACKENDS

        if backend not in GPU_BACKENDS:
            raise ValueError(f"--dry-run-kernel must be one of {GPU_BACKENDS}, got {backend!r}")
        self.backend = backend
        self.calls = {"forward": 0, "backward": 0}

    def __call__(self, func, args) -> int:
        from ..kernels.sdpa import dense
        from ..kernels.workspace import kernel_workspace

        if func is not _CPU_FLASH_FWD and func is not _CPU_FLASH_BWD:
            return 0
        backward = func is _CPU_FLASH_BWD
        self.calls["backward" if backward else "forward"] += 1
        tensors = args[:6] if backward else args[:3]  # (dout, q, k, v, out, lse) or (q, k, v)
        q, k = tensors[1 if backward else 0], tensors[2 if backward else 1]
        copied = sum(t.nbytes for t in tensors if t.dim() == 4 and dense(t) is not t) + \
            (tensors[5].nbytes if backward and not tensors[5].is_contiguous() else 0)
        b, hq, n_q, d = q.shape
        return kernel_workspace(self.backend, batch=b, q_heads=hq, kv_heads=k.shape[1], q_rows=n_q, k_rows=k.shape[2],
                                head_dim=d, element_size=q.element_size(), backward=backward, copied=copied)


def flash_workspace_bytes(func, args) -> int:
    """flash-attn 2's backward workspace of one local kernel call (:class:`GpuKernel` ``("flash_attn")``), for
    the CPU flash op's backward that stands for it on the fake tensors; 0 for any other op."""
    return GpuKernel("flash_attn")(func, args) if func is _CPU_FLASH_BWD else 0


def as_on_a_gpu(job) -> None:
    """The attention's path as a GPU takes it: a 16-bit ring step on a GPU is one kernel call per head group
    with the kernel's own backward (a world of one: one dense block, ``strategies.burst.alone``), while the
    CPU kernel of the fake tensors would run the engine's float32 tiles (other buffers, and at millions of
    tokens hours of fake ops). ``grad_partials="kernel"`` takes the GPU's path on the fake CPU tensors, for
    every context-parallel size and strategy that runs the engine's block calls (burst, ring, allgather, usp;
    ulysses and tp make one kernel call of the gathered sequence or heads already). The one switch; a run that
    names ``grad_partials`` keeps it."""
    from ..strategies import STRATEGIES

    options, spec = getattr(job.attn, "options", None), STRATEGIES.get(getattr(job.attn, "strategy", None))
    if isinstance(options, dict) and spec is not None and "grad_partials" in spec.options:
        options.setdefault("grad_partials", "kernel")
        if "device_type" in spec.options:  # the kernel policy of a GPU (kernels.policy), not of the fake tensors
            options.setdefault("device_type", "cuda")


def _pinned_state_extra(job) -> int:
    """What pinning adds to the offloaded optimizer state (FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` pins
    each parameter's padded shard and its gradient: power-of-two blocks; AdamW's moments are not pinned)."""
    from ..models.offload import pow2_bytes

    extra = 0
    for p in job.model.parameters():
        local = p._local_tensor if hasattr(p, "_local_tensor") else p
        nbytes = local.untyped_storage().nbytes()
        extra += 2 * (pow2_bytes(nbytes) - nbytes)
    return extra


def _check(cfg: TrainConfig, world_size: int, rank: int, device: str) -> None:
    if not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD:
        raise ValueError(f"--world-size must be an int from 1 to {MAX_WORLD} for --dry-run, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"--dry-run-rank must be in [0, {world_size}) (the --world-size), got {rank!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"dry_run: device must be 'cuda' or 'cpu', got {device!r}")
    # the same checks and messages as `burstattn train` on the modelled device (float16: a GPU's)
    check_config(cfg, world_size, device)
    if cfg.resume or cfg.ckpt_dir:
        raise ValueError("--dry-run runs one step of a fresh job: drop --resume / --ckpt-dir")


def unmetered(cfg: TrainConfig, dims) -> list[str]:
    """The collectives of the step that ``sent_bytes`` does not count: it meters burstattn's own
    (the attention strategies' and the recurrences' over ``cp``, :func:`burstattn.comm.comm_stats`),
    not those PyTorch runs for tensor parallelism (DTensor), FSDP2 or the gradient all-reduce."""
    out = []
    if dims.tp > 1:
        out.append(f"tensor parallelism's all-reduces / all-gathers / reduce-scatters (DTensor, tp {dims.tp})")
    if cfg.fsdp and dims.dp * dims.cp > 1:
        out.append(f"FSDP2's parameter all-gathers and gradient reduce-scatters (over {dims.dp * dims.cp} ranks)")
    elif dims.dp * dims.cp > 1:
        out.append(f"the gradient all-reduce over the {dims.dp * dims.cp} replicas (dp x cp)")
    return out


def _one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 200 characters of it)."""
    reason = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"{type(exc).__name__}: {reason}" if reason else type(exc).__name__


def _where(tracker) -> str:
    parents = [p for p in getattr(tracker._mod_tracker, "parents", ()) if p != "Global"]
    return max(parents, key=len) if parents else "(outside any module)"


@contextlib.contextmanager
def _fake_group(rank: int, world_size: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ValueError("--dry-run needs a process without a process group (torch.distributed is initialized)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _batch(job, step: int):
    """:func:`~burstattn.train.job.local_batch` on real host tensors (the data loader reads counts
    with ``int``): the positions recomputed as ``build_job`` computes them, outside the fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from ..parallel import shard_positions
    from .job import local_batch

    plan = check_parallel(job.cfg, job.dims.world)
    with unset_fake_temporarily():
        _, c, _ = job.dims.coords(dist.get_rank())
        pos = shard_positions(job.cfg.seq_len, strategy=plan.strategy, layout=plan.layout, cp_rank=c,
                              cp_size=job.dims.cp, ulysses_degree=plan.ulysses)
        return local_batch(dataclasses.replace(job, positions=pos, device=torch.device("cpu")), step)


def _phase_hooks(job, tracker) -> list:
    def forward(*_):
        tracker.phase = "forward"

    def backward(*_):
        tracker.phase = "backward"

    return [job.model.register_forward_pre_hook(forward), job.model.register_forward_hook(backward)]


def dry_run(cfg: TrainConfig, world_size: int, rank: int = 0, *, timeline: bool = False,
            device: str = "cuda", kernel: str = "sdpa") -> dict[str, Any]:
    """One step of ``cfg`` on rank ``rank`` of ``world_size``, with fake tensors, as it would run on
    ``device`` ("cuda": a GPU's AdamW (fused), attention path and the GPU ``kernel``'s workspace (:class:`GpuKernel`);
    "cpu": this machine's, to compare with a real step here). Returns the report
    (bytes are per rank): ``peak_bytes``, ``peak_by_category`` (:data:`CATEGORIES`), ``peak_by_phase``
    (:data:`PHASES`), ``step_peak_bytes``, ``start_bytes``, ``workspace_bytes``, ``host_bytes``,
    ``sent_bytes``, ``sent_by_op``, ``unmetered`` (what ``sent_bytes`` leaves out, :func:`unmetered`),
    ``attention_calls``, ``kernel``, ``kernel_calls`` (the local kernel's forward and backward calls), ``ops``,
    ``seconds``; with ``timeline`` also
    ``timeline``: ``[(op index, phase, bytes by category)]``.

    Raises:
        ValueError: a configuration ``burstattn train`` refuses (its message), or a bad rank/world size.
        DryRunError: the fake mode could not follow the step (the op and module in one line).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..comm import comm_stats
    from .job import build_job
    from .step import step_tensors

    _check(cfg, world_size, rank, device)
    gpu = GpuKernel(kernel) if device == "cuda" else None
    t0, c0 = time.perf_counter(), time.process_time()
    with _fake_group(rank, world_size), FakeTensorMode(allow_non_fake_inputs=True):
        try:
            job = build_job(cfg, optimizer_device=device)
        except ValueError:
            raise
        except Exception as exc:  # building the job (meshes, TP, FSDP2): one line, as for the step
            raise DryRunError(f"the fake mode cannot build the job: {_one_line(exc)}") from exc
        job.model.offload_host = torch.device("meta")  # --offload: the host copies leave the tracked device
        if device == "cuda":
            as_on_a_gpu(job)
        batch = _batch(job, DRY_STEP)
        tracked = next(job.model.parameters()).device
        host_refs = OFFLOADED if cfg.offload_optimizer and device == "cuda" else frozenset()  # CPUOffloadPolicy: host
        tracker = (FSDPDryRunTracker(job.model, job.optimizer, tracked, host_refs) if cfg.fsdp
                   else DryRunTracker(tracked))
        if not cfg.fsdp:
            tracker.track_external(job.model, job.optimizer)
        tracker.workspace_of = gpu
        tracker.host_device = job.model.offload_host
        hooks = _phase_hooks(job, tracker)
        try:
            with tracker, comm_stats() as stats:
                try:
                    warm_optimizer(job)
                    tracker.start()
                    _, _, _, host_bytes = step_tensors(job, DRY_STEP, batch)
                except (ValueError, DryRunError):
                    raise
                except Exception as exc:  # one line: the op, the module, the reason
                    raise DryRunError(f"the fake mode cannot follow {tracker.last_op or 'an op'} in module "
                                      f"{_where(tracker)}: {_one_line(exc)}") from exc
        finally:
            for h in hooks:
                h.remove()
    workspace, phase_peaks = tracker.workspace_bytes, dict(tracker.phase_peaks)
    pinned = tracker.host_pinned + (_pinned_state_extra(job) if host_refs else 0)
    peak, split = tracker.peak_bytes, dict(tracker.peak_split)
    report = dict(rank=rank, world_size=world_size, device=device, peak_bytes=int(peak), peak_by_category=split,
                  peak_by_phase=phase_peaks, step_peak_bytes=int(tracker.peak_bytes - tracker.start_bytes),
                  start_bytes=int(tracker.start_bytes), workspace_bytes=workspace,
                  kernel=gpu.backend if gpu else "cpu_flash",
                  kernel_calls=dict(gpu.calls) if gpu else None,
                  workspace=(f"the CPU flash op's outputs; {gpu.backend}'s buffers added at each call (float32 dq_accum and "
                             "softmax_d, the expanded dK/dV of grouped K/V heads"
                             + (", copies of row slices)" if gpu.backend == "sdpa" else ")")) if gpu else "none (CPU)",
                  host_bytes=int(pinned + tracker.host_state_bytes) if gpu else int(host_bytes) + tracker.host_state_bytes,
                  host_copied_bytes=int(host_bytes) + tracker.host_state_bytes, host_activation_bytes=int(host_bytes),
                  host_pinned_activation_bytes=int(tracker.host_pinned),
                  host_state_bytes=int(tracker.host_state_bytes), sent_bytes=int(stats.sent()), sent_by_op=stats.sent_by_op("str"),
                  unmetered=unmetered(cfg, job.dims),
                  attention_calls=tracker.attention_calls, peak_at=dict(zip(("op", "phase", "module"), tracker.peak_at)), ops=tracker.ops,
                  dims=dict(dp=job.dims.dp, cp=job.dims.cp, tp=job.dims.tp), strategy=cfg.strategy,
                  layout=job.layout, chunks=[job.model.config.mlp_chunk, job.model.config.loss_chunk],
                  seconds=time.perf_counter() - t0, cpu_seconds=time.process_time() - c0)
    if timeline:
        report["timeline"] = dict(categories=list(CATEGORIES), phases=list(PHASES), points=tracker.points)
    return report
