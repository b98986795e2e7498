"""The dry run's memory tracker: PyTorch's ``MemTracker`` (``FSDPMemTracker`` for FSDP2) with
the step's timeline, its peak by phase, and the library's own ops run for real.

burstattn's distributed attention is a registered op (``burstattn::attention_fwd`` ...) with a
fake implementation that only allocates its outputs: enough for ``torch.compile``, not for a
memory estimate (the ring's buffers, the received K/V, the float32 gradient partials would be
missing). Under the tracker these ops run their real implementation on the fake tensors, so the
tracker sees every allocation of the ring's steps and the fake process group carries their
messages (and :func:`burstattn.comm_stats` counts them).

Categories: the trackers' reference types folded into five: ``parameters`` (parameters, buffers,
FSDP's sharded and unsharded parameters and all-gather outputs), ``gradients`` (gradients, FSDP's
sharded and unsharded gradients and reduce-scatter inputs), ``optimizer`` (optimizer state),
``activations`` (what the forward and its recomputation allocate, and the step's inputs),
``temporaries`` (what the backward allocates beyond that, and anything else).

Host-resident state: with FSDP2's ``CPUOffloadPolicy`` (``--offload-optimizer``) the sharded
parameters, their sharded gradients and the optimizer state live in host memory. The fake tensors
are all CPU tensors, so the tracker tells them apart by reference type (:data:`OFFLOADED`): they are
left out of the device's bytes and counted as ``host_state_bytes`` (the most held at once).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker

from ..models.offload import pow2_bytes

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")
PHASES = ("forward", "backward", "optimizer")
_CATEGORY = {"Parameter": "parameters", "Buffer": "parameters", "Sharded Param": "parameters",
             "Unsharded Param": "parameters", "All Gather": "parameters", "Gradient": "gradients",
             "Sharded Grad": "gradients", "Unsharded Grad": "gradients", "Reduce Scatter": "gradients",
             "Optstate": "optimizer", "OptState": "optimizer", "Activation": "activations", "Inputs": "activations",
             "Temp": "temporaries", "Other": "temporaries"}
OFFLOADED = frozenset({"Sharded Param", "Sharded Grad", "Optstate", "OptState"})  # host-resident with offload
LIBRARY = "burstattn"
ATTENTION_OPS = ("burstattn::attention_fwd", "burstattn::strategy_fwd")
# A fake tensor answers `.device` through the dispatcher (``prim.device``): it allocates nothing and
# returns no tensor, so the tracker passes it straight to the fake mode beneath
_DEVICE = torch.ops.prim.device.default
_A = torch.ops.aten
_EMPTY = _A.empty.memory_format
# Ops whose output is (a view of) their first argument and that allocate nothing: once that argument's
# storage is tracked, MemTracker would record nothing new for them (no new storage, the same total), so
# they skip its bookkeeping (a third of the step's dispatches). A storage not yet tracked goes through it.
ALIASING = frozenset({
    _A.slice.Tensor, _A.select.int, _A.alias.default, _A.unsqueeze.default, _A.transpose.int, _A.view.default,
    _A.expand.default, _A.t.default, _A.permute.default, _A.squeeze.dim, _A.detach.default, _A.as_strided.default,
    _A.add_.Tensor, _A.sub_.Tensor, _A.mul_.Tensor, _A.div_.Tensor, _A.copy_.default, _A.nan_to_num_.default,
    _A.masked_fill_.Scalar, _A.zero_.default, _A.fill_.Scalar})


def category_of(reftype: Any) -> str:
    """The dry run's category of a tracker reference type (its string value)."""
    return _CATEGORY.get(str(getattr(reftype, "value", reftype)), "temporaries")


def _real_impl(func) -> Optional[Any]:
    """The Python implementation of one of the library's custom ops (``None`` for any other op)."""
    from torch._library.custom_ops import OPDEFS

    name = func.name().split(".")[0] if hasattr(func, "name") else ""
    if not name.startswith(LIBRARY + "::"):
        return None
    opdef = OPDEFS.get(name)
    return None if opdef is None else opdef._init_fn


class _Timeline:
    """Mixed into a tracker: after every op, the device bytes by category (the timeline, one point
    per op that changed the total), the peak with its categories, and the peak of each phase.

    ``phase`` is set by the caller (:func:`burstattn.train.dryrun.dry_run`'s hooks: forward until the
    model returns, backward until the optimizer steps, optimizer after). ``device``: the device
    whose memory is tracked (the fake tensors' device)."""

    def _init_timeline(self, device: torch.device, host_refs: frozenset = frozenset()) -> None:
        self.device, self.phase, self.recording = device, "forward", False
        self.host_refs, self.host_state_bytes = frozenset(host_refs), 0
        self.points: list[tuple[int, str, tuple[int, ...]]] = []
        self.peak_bytes, self.peak_split = 0, dict.fromkeys(CATEGORIES, 0)
        self.phase_peaks = dict.fromkeys(PHASES, 0)
        self.start_bytes, self.ops, self.attention_calls = 0, 0, 0
        self.last_op, self._last_total, self.peak_at = "", -1, ("", "", "")
        self._impls: dict = {}  # op -> the library's implementation (None: any other op)
        self.workspace_of: Optional[Any] = None  # (op, args) -> a GPU kernel's workspace bytes of that call
        self.workspace_bytes = 0  # the largest workspace of one call
        self.host_device: Optional[torch.device] = None  # where the offloaded copies go (the dry run: meta)
        self.host_pinned = 0  # those copies as the pinned host allocator holds them (power-of-two blocks)

    def _workspace(self, nbytes: int) -> None:
        """A kernel call's workspace, alive while the call runs (its outputs allocated): a point of the
        timeline and a candidate peak, as temporaries."""
        if not self.recording or nbytes <= 0:
            return
        self.workspace_bytes = max(self.workspace_bytes, nbytes)
        self._point(self._device_total() + nbytes, nbytes)
        self._last_total = -1  # the next op's point comes back down

    def _point(self, total: int, extra: int = 0) -> None:
        """A point of the timeline at ``total`` device bytes (``extra`` of them temporaries the tracker does
        not hold: a kernel's workspace), the phase's peak and the step's."""
        phase = "optimizer" if self._in_opt else self.phase
        self.phase_peaks[phase] = max(self.phase_peaks[phase], total)
        split = self.now()
        split["temporaries"] += extra
        self.points.append((self.ops, phase, tuple(split[c] for c in CATEGORIES)))
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_split = total, split
            self.peak_at = (self.last_op, phase, max(self._mod_tracker.parents, key=len, default=""))

    def now(self) -> dict[str, int]:
        """The device's bytes now, by category (host-resident references left out)."""
        split = dict.fromkeys(CATEGORIES, 0)
        for ref, nbytes in self._curr_mem_snap.get(self.device, {}).items():
            name = str(getattr(ref, "value", ref))
            if name != "Total" and name not in self.host_refs:
                split[category_of(ref)] += nbytes
        return split

    def _device_total(self) -> int:
        """The device's bytes now: the tracker's total less the host-resident references (noted)."""
        snap = self._curr_mem_snap.get(self.device, {})
        total = snap.get("Total", 0)
        if self.host_refs:
            host = sum(n for ref, n in snap.items() if str(getattr(ref, "value", ref)) in self.host_refs)
            self.host_state_bytes = max(self.host_state_bytes, host)
            total -= host
        return total

    def start(self) -> None:
        """Begin the measured step: forget the peak so far (the warm-up's) and note the bytes held now."""
        split = self.now()
        self.recording, self.start_bytes = True, sum(split.values())
        self._device_total()  # the host state held before the step
        self.peak_bytes, self.peak_split = self.start_bytes, split
        self.phase_peaks = dict.fromkeys(PHASES, 0)
        self.points = [(0, self.phase, tuple(split[c] for c in CATEGORIES))]

    def _tracked(self, t) -> bool:
        """Whether ``t``'s storage is one the tracker already counts (``_WINFO``: MemTracker's storages)."""
        return isinstance(t, torch.Tensor) and t.untyped_storage() in self._WINFO

    def _update_peak_stats(self, peak_state) -> None:  # the trackers call it after every op
        if not self.recording:
            return
        self.ops += 1
        total = self._device_total()
        phase = "optimizer" if self._in_opt else self.phase
        self.phase_peaks[phase] = max(self.phase_peaks[phase], total)  # a phase may begin at an unchanged total
        if total != self._last_total:
            self._last_total = total
            self._point(total)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # a fake tensor's `.device` (half of all dispatches): no memory to track
            return func(*args, **(kwargs or {}))
        if func in ALIASING and all(t is FakeTensor for t in types) and self._tracked(args[0]):
            return func(*args, **(kwargs or {}))
        self.last_op = str(func)
        if func not in self._impls:
            self._impls[func] = _real_impl(func)
        impl = self._impls[func]
        if impl is None:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.workspace_of is not None:
                self._workspace(self.workspace_of(func, args))
            if func is _EMPTY and self.recording and self.host_device is not None \
                    and (kwargs or {}).get("device") == self.host_device:  # an offloaded copy (HostOffload)
                self.host_pinned += pow2_bytes(out.nbytes)  # one pinned block
            return out
        if func.name().split(".")[0] in ATTENTION_OPS:
            self.attention_calls += 1
        with self:  # the op's own tensor code, seen by this tracker and run by the fake mode beneath
            return impl(*args, **(kwargs or {}))


class DryRunTracker(_Timeline, MemTracker):
    """``MemTracker`` with the dry run's timeline (models without FSDP)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self._init_timeline(device)


class FSDPDryRunTracker(_Timeline, FSDPMemTracker):
    """``FSDPMemTracker`` with the dry run's timeline (FSDP2 models; ``mod`` the root FSDP module)."""

    def __init__(self, mod, optimizer, device: torch.device, host_refs: frozenset = frozenset()) -> None:
        super().__init__(mod, optimizer)
        self._init_timeline(device, host_refs)
