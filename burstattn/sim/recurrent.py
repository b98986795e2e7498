"""The state passing of hybrid models' recurrent layers at a cp degree: memory, time, the scheme (pure).

Every Gated DeltaNet layer passes per-segment summaries ``S -> A S + B`` between the cp ranks
(:mod:`burstattn.recurrent.schemes`; ``A [b, H, dk, dk]``, ``B [b, H, dk, dv]``, float32):

* ``allgather``: every rank keeps the ``P x K`` gathered maps (``K = 2`` under zigzag) and the
  fold's ``2P - 3`` intermediate states until the backward: memory and fold work grow with ``P``.
* ``scan``: the log-depth prefix scan (``ceil(log2 (2P - 1))`` rounds and a shift): a rank keeps
  what it received and the maps it composed, ``O(log P)``.

:func:`passing_memory` counts what a rank keeps for the backward, the worst rank's, from the same
plans the library runs (:func:`burstattn.recurrent.scan.plan_runs`; tests/dist/test_recurrent.py
compares it with the saved tensors of a real call). :func:`passing_time` prices both with the
cluster's links (:mod:`.net`) and the kernels' fixed cost; :func:`scan_threshold` is the smallest
cp from which the scan is not slower: ``scheme="auto"`` takes the scan from
:data:`burstattn.recurrent.SCAN_MIN_WORLD` ranks on, which this derivation is tested to give.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..models.config import HybridConfig, LlamaConfig
from ..recurrent.scan import Round, plan_runs, scan_traffic, zigzag_runs
from . import net
from .hardware import ClusterHW

CP_GRID = tuple(2 ** k for k in range(1, 11))  # 2 .. 1024: where the threshold is looked for


@dataclass(frozen=True)
class StateShape:
    """One recurrent layer's summaries on one rank."""

    batch: int
    heads: int
    dk: int
    dv: int
    matrix: bool = True
    """A ``dk x dk`` transition (delta rule) or a scalar decay."""
    element_size: int = 4
    """The summaries' dtype (the compute dtype: float32 for 16-bit models)."""

    @property
    def a(self) -> int:
        """Bytes of one transition ``A``."""
        return self.batch * self.heads * (self.dk * self.dk if self.matrix else 1) * self.element_size

    @property
    def state(self) -> int:
        """Bytes of one state ``B``."""
        return self.batch * self.heads * self.dk * self.dv * self.element_size

    @property
    def full(self) -> int:
        """Bytes of one map ``[A | B]``."""
        return self.a + self.state


def state_shape(model: LlamaConfig, batch: int, tp: int = 1) -> Optional[StateShape]:
    """The summaries of ``model``'s Gated DeltaNet layers (``None`` for a model without any)."""
    if not isinstance(model, HybridConfig):
        return None
    return StateShape(batch, max(1, model.linear_num_value_heads // tp), model.linear_key_head_dim,
                      model.linear_value_head_dim)


def recurrent_layers(model: LlamaConfig) -> int:
    """How many of ``model``'s layers pass recurrent state (0 for an all-attention model)."""
    if not isinstance(model, HybridConfig):
        return 0
    return sum(not model.is_attention(i) for i in range(model.n_layers))


def resolve(scheme: str, cp: int) -> str:
    """``"auto"`` as the library resolves it (:func:`burstattn.recurrent.schemes.resolve_scheme`)."""
    from ..recurrent.schemes import resolve_scheme
    return resolve_scheme(scheme, cp)


def _scan_kept(plan, rank: int, s: StateShape) -> float:
    """Bytes ``rank`` keeps for the backward of the scan: each composition saves the earlier value
    (received, or a local one it composed before) and the later one's transition once it is not the
    summary itself; the shift's received state is saved by the correction."""
    combined, kept = set(), 0.0
    for rnd in plan.rounds:
        mine = [m for m in rnd.moves if plan.owner[m[1]] == rank]
        for src, dst, full in mine:
            if plan.owner[src] != rank or src in combined:
                kept += s.full if full else s.state
            if dst in combined:
                kept += s.a
        combined |= {dst for _, dst, _ in mine}
    for src, dst in plan.shift:
        if plan.owner[dst] == rank and (plan.owner[src] != rank or src in combined):
            kept += s.state
    return kept


def passing_memory(s: StateShape, cp: int, scheme: str = "auto", final: bool = False) -> float:
    """Bytes one rank (the worst) keeps for the backward of one layer's state passing (zigzag, one
    document per row): ``allgather`` ``P K`` maps and ``2P - 3`` states; ``scan`` per
    :func:`_scan_kept`."""
    if cp <= 1:
        return 0.0
    if resolve(scheme, cp) == "allgather":
        slots = 1 if cp == 2 and not final else 2
        return float(cp * slots * s.full + max(0, 2 * cp - 3) * s.state)
    owner, flags, needs_in = zigzag_runs(cp)
    plan = plan_runs(owner, (), flags, needs_in, final)
    return max(_scan_kept(plan, r, s) for r in range(cp))


def passing_transient(s: StateShape, cp: int, scheme: str = "auto") -> float:
    """Bytes one layer's state-passing backward adds while it runs (the worst rank): ``allgather``
    the gathered maps' gradient (``P K`` maps, reduce-scattered); ``scan`` a round's gradients (the
    values it sent and received in its largest round)."""
    if cp <= 1:
        return 0.0
    if resolve(scheme, cp) == "allgather":
        return float(cp * 2 * s.full)
    owner, flags, needs_in = zigzag_runs(cp)
    worst = 0.0
    for steps in scan_traffic(plan_runs(owner, (), flags, needs_in), cp):
        for (fs, ss), (fr, sr) in steps:
            worst = max(worst, (fs + fr) * s.full + (ss + sr) * s.state)
    return worst


def kept_bytes(model: LlamaConfig, *, batch: int, cp: int, tp: int = 1, scheme: str = "auto") -> tuple:
    """``(kept, transient)`` bytes per device of ``model``'s state passing in a training step at
    ``cp``: every recurrent layer's kept summaries (:func:`passing_memory`) and one layer's
    backward transient (:func:`passing_transient`); ``(0, 0)`` for a model without recurrent layers."""
    s = state_shape(model, batch, tp)
    if s is None or cp <= 1:
        return 0.0, 0.0
    return recurrent_layers(model) * passing_memory(s, cp, scheme), passing_transient(s, cp, scheme)


def _kernels(hw: ClusterHW, flops: float, kernels: int, float32: bool = True) -> float:
    rate = (hw.fp32_flops or hw.peak_flops) if float32 else hw.peak_flops
    return flops / (rate * hw.matmul_eff) + kernels * hw.kernel_overhead_s


def passing_time(s: StateShape, cp: int, hw: ClusterHW, scheme: str = "auto", stride: int = 1) -> float:
    """Seconds of one layer's state passing, forward and backward (zigzag, one document per row),
    on the slowest rank: the collectives or rounds (alpha-beta over the links the group spans) and
    the small float32 products with their fixed kernel cost. ``stride``: global ranks between cp
    neighbours (the tp degree)."""
    if cp <= 1:
        return 0.0
    apply_f = 2 * s.batch * s.heads * s.dk * s.dk * s.dv if s.matrix else s.state / s.element_size
    if resolve(scheme, cp) == "allgather":
        pl = net.placement(hw, cp, stride)
        comm = net.all_gather_time(pl, 2 * s.full) + net.reduce_scatter_time(pl, 2 * s.full)
        steps = 2 * cp - 1  # the fold on every rank: an apply and an add per segment; twice that backward
        return comm + _kernels(hw, 3 * steps * apply_f, 6 * steps)
    compose_f = apply_f + (2 * s.batch * s.heads * s.dk ** 3 if s.matrix else 0)
    owner, flags, needs_in = zigzag_runs(cp)
    plan = plan_runs(owner, (), flags, needs_in)
    node = lambda r: (r * stride) // hw.devices_per_node  # noqa: E731
    total = 0.0
    for rnd in list(plan.rounds) + [Round(1, tuple((a, b, False) for a, b in plan.shift))]:
        sent, cross, combines = {}, set(), {}
        for src, dst, full in rnd.moves:
            a, b = plan.owner[src], plan.owner[dst]
            combines[b] = combines.get(b, 0) + 1
            if a != b:
                sent[a] = sent.get(a, 0) + (s.full if full else s.state)
                if node(a) != node(b):
                    cross.add(a)
        link = max((net.p2p_time(hw, n, r not in cross) for r, n in sent.items()), default=0.0)
        work = max(combines.values(), default=0)
        total += 2 * link + _kernels(hw, 3 * work * compose_f, 12 * work)  # forward, then its mirror
    return total


def passing_seconds(model: LlamaConfig, *, batch: int, cp: int, tp: int, hw: ClusterHW, train: bool = True,
                    scheme: str = "auto") -> float:
    """Seconds of a step's state passing over all of ``model``'s recurrent layers (:func:`passing_time`;
    the forward's share, a third, without training); 0 for a model without recurrent layers."""
    s = state_shape(model, batch, tp)
    if s is None or cp <= 1:
        return 0.0
    t = recurrent_layers(model) * passing_time(s, cp, hw, scheme, stride=tp)
    return t if train else t / 3


def scan_threshold(s: StateShape, hw: ClusterHW, stride: int = 1) -> int:
    """The smallest cp of :data:`CP_GRID` from which the scan is no slower than the all-gather at
    every larger cp of the grid (:func:`passing_time`); the last one + 1 if never."""
    faster = [passing_time(s, cp, hw, "scan", stride) <= passing_time(s, cp, hw, "allgather", stride)
              for cp in CP_GRID]
    for i in range(len(CP_GRID)):
        if all(faster[i:]):
            return CP_GRID[i]
    return CP_GRID[-1] + 1


REFERENCE = {
    "hybrid-small": StateShape(1, 4, 64, 64),
    # Qwen3-Next-80B-A3B (its config.json): 32 value heads of 128 x 128, 36 of its 48 layers Gated DeltaNet
    "qwen3-next-80b": StateShape(1, 32, 128, 128),
}
"""The shapes whose threshold ``scheme="auto"`` follows (batch 1, float32 summaries)."""
REFERENCE_CLUSTER = "h100-nvlink-ib"


def derived_min_world(hw: ClusterHW) -> int:
    """The cp from which ``scheme="auto"`` should take the scan on ``hw``: the smallest
    :func:`scan_threshold` of the :data:`REFERENCE` shapes (from there the scan is no slower for
    the larger states, and its memory is smaller for all)."""
    return min(scan_threshold(s, hw) for s in REFERENCE.values())
