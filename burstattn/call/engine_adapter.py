"""The engine's adapter: the kernel choice (:func:`kernel_needs`, :func:`block_calls`), every rank's
positions (:func:`call_positions`) and the two engine calls, :func:`forward_pass` and
:func:`backward_pass` (formerly ``burstattn.autograd``; used by burst and ring, ulysses and tp through
:mod:`~burstattn.strategies.local`, allgather, usp, and decoding in :mod:`burstattn.infer`).

Both passes validate nothing (the callers run the cross-rank input check first). The custom ops
of :mod:`burstattn.ops` call exactly these two functions, so which engine functions run is
decided here, in one place: the one loop of :mod:`burstattn.engine.run`. Inputs and outputs use
flash-attn's ``[B, n, H, D]``; the engine copies head groups to ``[B, h, n, D]`` as it goes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from ..comm.groups import GroupContext
from ..comm.host import host_side
from ..comm.stats import CommStats, active_stats
from ..comm.trace import StepTrace, active_trace
from ..comm.transport import pass_transport
from ..engine.compute import BlockCalls
from ..engine.run import attention_backward, attention_forward, build_plan, head_groups, memo_plan
from ..kernels import ScoreMods, get_kernel, resolve_backend
from ..kernels.flex import FlexPair
from ..kernels.pair import VarlenPair
from ..kernels.policy import KernelPolicy, kernel_policy
from ..layouts.named import local_positions
from ..masks.blocks import layout_key, op_mask
from ..masks.pairs import flex_pair, varlen_bands
from ..masks.setup import GuardedMaskMod, effective_mask, raise_mask_failures
from .call import Call


DOUBLE_BACKWARD = ("burstattn: second-order gradients (create_graph=True through the attention backward, "
                   "double backward) are not supported")


def without_autocast(fn):
    """Run ``fn`` with autocast off on the device of its first tensor argument: attention computes in
    its inputs' dtype under ``torch.autocast`` too (one behaviour for every strategy; cast q, k, v
    yourself for another precision)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        with torch.autocast(device, enabled=False):
            return fn(*args, **kwargs)

    return run


def refuse_double_backward() -> None:
    """Raise in an attention backward that runs with ``create_graph=True`` (grad mode on): its result
    would not be differentiable, and a silently wrong second derivative is worse than an error."""
    if torch.is_grad_enabled():
        raise RuntimeError(DOUBLE_BACKWARD)


def guarded(cfg: Call):
    """The call's mask with its ``mask_mod`` guarded (see :class:`~burstattn.masks.setup.GuardedMaskMod`),
    and the guard (``None`` without a ``mask_mod``)."""
    mask = effective_mask(cfg)
    if mask.mask_mod is None:
        return None, None
    guard = GuardedMaskMod(mask.mask_mod)
    return replace(mask, mask_mod=guard), guard


@dataclass(frozen=True)
class CallPositions:
    """Every rank's positions of one call: ``q`` (global query positions per rank), ``aligned`` (the
    same in the keys' coordinates, :meth:`burstattn.AttnMask.aligned`), ``k`` (global key positions
    per rank), and the two global lengths."""

    q: list
    aligned: list
    k: list
    q_len: int
    k_len: int


def call_positions(cfg: Call, world: int, n_q: int, n_k: int, mask=None) -> CallPositions:
    """The :class:`CallPositions` of a call with ``n_q`` query and ``n_k`` key rows per rank."""
    q_len, k_len = n_q * world, n_k * world
    q = [local_positions(q_len, r, world, cfg.layout) for r in range(world)]
    k = [local_positions(k_len, r, world, cfg.keys_layout) for r in range(world)]
    m = effective_mask(cfg) if mask is None else mask
    return CallPositions(q, [m.aligned(x, q_len, k_len) for x in q], k, q_len, k_len)


def kernel_needs(cfg: Call, head_dim: int, v_head_dim: int) -> frozenset:
    """What the call asks of its kernel (see :data:`burstattn.kernels.NEEDS`)."""
    return frozenset(n for n, on in (("softcap", cfg.softcap is not None), ("alibi", cfg.alibi is not None),
                                     ("v_head_dim", v_head_dim != head_dim), ("deterministic", cfg.deterministic))
                     if on)


def step_policy(cfg: Call, q: torch.Tensor, v: torch.Tensor, mask_kind: str = "none") -> KernelPolicy:
    """The :class:`~burstattn.kernels.policy.KernelPolicy` of the call's steps: for ``cfg.device_type``
    (the device the step is modelled on), else the tensors' own device."""
    return kernel_policy(cfg.device_type or q.device.type, q.dtype, cfg.backend, mask_kind, cfg.grad_partials,
                         kernel_needs(cfg, q.shape[-1], v.shape[-1]))


def pair_calls(cfg: Call, policy: KernelPolicy, pos: CallPositions, mask) -> tuple[object, Callable]:
    """``(pair_kernel, pair_spec)`` of a masked call whose pairs run in one kernel call
    (:class:`~burstattn.engine.compute.BlockCalls`): the varlen kernels' bands or Flex's block mask of the
    pair of ranks ``(q_owner, k_owner)`` from their positions (``None``: the pair keeps its block ops)."""
    if policy.masked == "flex":
        raw = getattr(mask.mask_mod, "fn", mask.mask_mod)  # the user's predicate (not the eager guard)
        home = cfg.mask if cfg.mask is not None else mask  # the user's object holds the cache (not the guarded copy)

        def spec(q_owner: int, k_owner: int):
            with host_side():
                return flex_pair(home, cfg.causal, pos.q[q_owner], pos.k[k_owner], pos.q_len, pos.k_len, raw)
        return FlexPair(home.cache), spec
    kernel = VarlenPair(policy.kernel)

    def bands(q_owner: int, k_owner: int):
        with host_side():
            got = varlen_bands(mask, cfg.causal, pos.q[q_owner], pos.k[k_owner], pos.q_len, pos.k_len)
        return got if got is not None and got.calls and kernel.supports(got) else None
    return kernel, bands


def block_calls(cfg: Call, masked: bool, pos: CallPositions, scale: float, q: torch.Tensor, v: torch.Tensor,
                alibi: Optional[torch.Tensor] = None, mask=None) -> BlockCalls:
    """The kernel calls of a call: the one kernel choice (``cfg.backend``, resolved), the one
    fallback for PARTIAL ops when that kernel takes no mask, and the step policy
    (:func:`step_policy`: float32 gradient tiles or the kernel's own partials; a masked pair as one
    kernel call on CUDA). ``masked``: the plan has PARTIAL ops (a mask plan,
    :class:`~burstattn.masks.plan.MaskPlan`), whose bool blocks come from ``mask`` (default the call's own)
    at the positions ``pos``; ``alibi``: the ``[B or 1, Hq]`` slopes (float32). ``q``, ``v``: any tensors of
    the call's device, dtype and head sizes."""
    kernel = get_kernel(cfg.backend, deterministic=cfg.deterministic)
    mods = None
    if cfg.softcap is not None or alibi is not None:
        mods = ScoreMods(softcap=cfg.softcap, alibi=alibi)
    grad_kernel = kernel
    if not kernel.float32:  # flash-attn: the float32 partials run on a kernel that takes float32
        needs = kernel_needs(cfg, q.shape[-1], v.shape[-1])
        grad_kernel = get_kernel(resolve_backend("auto", q.device, torch.float32, needs))
    mask = effective_mask(cfg) if masked and mask is None else mask
    policy = step_policy(cfg, q, v, mask.kind if masked else "none")
    calls = BlockCalls(kernel, scale, mods=mods, positions=(pos.aligned, pos.k) if alibi is not None else None,
                       fp32_grads=policy.grad_partials == "float32", grad_kernel=grad_kernel)
    if not masked:
        return calls
    if policy.one_call:
        pair_kernel, pair_spec = pair_calls(cfg, policy, pos, mask)
        calls = replace(calls, pair_kernel=pair_kernel, pair_spec=pair_spec)

    def mask_of(op, q_owner: int, k_owner: int):
        return op_mask(mask, cfg.causal, pos.q_len, pos.q[q_owner], pos.k[k_owner], op, pos.k_len)
    # flash-attn: no explicit masks (the sdpa kernel, or the plain one for modifiers sdpa lacks)
    fallback = kernel if kernel.supports_mask else get_kernel(
        resolve_backend("auto", q.device, q.dtype, kernel_needs(cfg, q.shape[-1], v.shape[-1]) | {"mask"}))
    return replace(calls, mask_of=mask_of, fallback=fallback)


def engine_pass(where: GroupContext, cfg: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                travelling: str, mask_plan, scale: float, alibi=None, mask=None):
    """The plan and the kernel calls of one pass (``travelling``: ``"kv"`` or ``"q"``). Dense or masked,
    one producer: the plan comes from every rank's positions (:func:`call_positions`), a masked call's
    block ops from its mask's summary (``mask_plan.blocks``) on the sparse schedule."""
    p = where.world_size
    per_node = cfg.topology.ranks_per_node if cfg.schedule == "double" and p > 1 else 1
    blocks = None if mask_plan is None else mask_plan.blocks
    schedule = cfg.schedule if blocks is None else "sparse"

    def make():
        with host_side():  # positions and plans are host-side (real tensors in a dry run too)
            pos = call_positions(cfg, p, q.shape[1], k.shape[1])
            # the dense producer reads queries in the keys' coordinates; a mask's summary aligns them itself
            return build_plan(where.rank, p, positions=pos.aligned if blocks is None else pos.q, kv_positions=pos.k,
                              causal=cfg.causal, travelling=travelling, schedule=schedule, ranks_per_node=per_node,
                              blocks=blocks), pos
    if blocks is None and cfg.mask is not None:  # positions aligned by a mask the key would not hold
        plan, pos = make()
    else:
        # the plan and positions are a pure function of these values (the mask's by its summary), and a
        # model's layers repeat them every step: kept in the one memo of plans, beside build_plan's entries
        key = ("pass", where.rank, p, int(q.shape[1]), int(k.shape[1]), layout_key(cfg.layout),
               layout_key(cfg.keys_layout), cfg.causal, travelling, schedule, per_node, blocks)
        plan, pos = memo_plan(key, make)
    return plan, block_calls(cfg, blocks is not None, pos, scale, q, v, alibi, mask)


def _slopes(alibi: Optional[torch.Tensor], batch: int) -> Optional[torch.Tensor]:
    """ALiBi slopes ``[Hq]`` or ``[B, Hq]`` -> ``[1 or B, Hq]`` float32."""
    if alibi is None:
        return None
    return (alibi if alibi.dim() == 2 else alibi.unsqueeze(0)).float()


@without_autocast
def forward_pass(where: GroupContext, cfg: Call, plan, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, alibi: Optional[torch.Tensor] = None,
                 sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The distributed forward on this rank's shard.

    Args:
        q: ``[B, n, Hq, D]``; k: ``[B, n_k, Hkv, D]``; v: ``[B, n_k, Hkv, Dv]``; ``cfg`` resolved
            (concrete backend and backward mode); ``plan``: the mask plan of a sparse call, else
            ``None``; ``alibi``: slopes ``[Hq]`` or ``[B, Hq]``; ``sinks``: logits ``[Hq]``.
    Returns:
        ``out [B, n, Hq, Dv]`` (q's dtype) and ``lse [B, Hq, n]`` (float32; float64 for float64;
        sinks included). The backward needs the inputs, ``out`` and ``lse`` (nothing else is kept).
    """
    b, n, hq, d = q.shape
    scale = cfg.scale_for(d)
    comm = pass_transport(where, "forward", active_stats(), active_trace(), cfg.topology)
    mask, guard = guarded(cfg) if plan is not None else (None, None)
    eplan, calls = engine_pass(where, cfg, q, k, v, "kv", plan, scale, _slopes(alibi, b), mask)
    out, lse = attention_forward(comm, eplan, calls, q, k, v, head_groups(b, n, hq, k.shape[2], d), sinks)
    raise_mask_failures(guard, where)
    return out, lse


@without_autocast
def backward_pass(where: GroupContext, cfg: Call, plan, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, stats: Optional[CommStats] = None,
                  trace: Optional[StepTrace] = None, alibi: Optional[torch.Tensor] = None,
                  sinks: Optional[torch.Tensor] = None):
    """The distributed backward: ``dout, out [B, n, Hq, Dv]``, ``q [B, n, Hq, D]``, ``k [B, n_k, Hkv, D]``,
    ``v [B, n_k, Hkv, Dv]``, ``lse [B, Hq, n]`` -> ``dq, dk, dv`` in the inputs' dtypes and shapes, and
    ``dsinks [Hq]`` (float32; ``None`` without sinks; this rank's share). Bytes and steps go to the
    active meter and trace (else ``stats`` / ``trace``)."""
    stats, trace = active_stats() or stats, active_trace() or trace
    b, n, hq, d = q.shape
    comm = pass_transport(where, "backward", stats, trace, cfg.topology)
    mask, guard = guarded(cfg) if plan is not None else (None, None)
    eplan, calls = engine_pass(where, cfg, q, k, v, cfg.travelling("backward"), plan, cfg.scale_for(d), _slopes(alibi, b), mask)
    grads = attention_backward(comm, eplan, calls, dout, q, k, v, out, lse, head_groups(b, n, hq, k.shape[2], d),
                               sinks)
    raise_mask_failures(guard, where)
    return grads
