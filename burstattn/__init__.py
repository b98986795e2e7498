"""burstattn: exact attention over sequences sharded across the ranks of a process group.

Importing this package imports nothing but the standard library: every public name below is
imported on first use (PEP 562), so ``burstattn --help`` answers without loading torch, and
``import burstattn`` then ``burstattn.attention`` imports torch and the core only. Nothing runs
at import time but one entry in ``sys.meta_path``: the finder of the moved names (:data:`MOVED`).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings
from importlib.machinery import ModuleSpec
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it (relative to this package)
_EXPORTS = {
    "BurstAttention": ".api", "burst_attn_func": ".api", "BurstOptions": ".call.options",
    "CommStats": ".comm.stats", "comm_stats": ".comm.stats",
    "ring_bytes": ".engine.bytes",
    "attention": ".strategies",
    "gather_sequence": ".layouts.named", "sequence_positions": ".layouts.named", "shard_sequence": ".layouts.named",
    "two_level_groups": ".comm.groups",
    "AttnMask": ".masks",
    "Partition": ".layouts.partition", "document_partition": ".layouts.partition",
    "mask_partition": ".masks.partition_solver",
    "StepTrace": ".comm.trace", "trace_steps": ".comm.trace",
}

__all__ = ["attention", "burst_attn_func", "BurstAttention", "BurstOptions", "shard_sequence", "gather_sequence",
           "sequence_positions", "comm_stats", "CommStats", "trace_steps", "StepTrace",
           "ring_bytes", "AttnMask", "Partition", "document_partition", "mask_partition", "two_level_groups",
           "__version__"]

_CHECKOUT = "the repository's bench/, not installed: from a source checkout, `python -m bench ...` or `burstattn bench ...`"

MOVED = {
    # modules: the old path imports the new module's names
    "burstattn.layout": "burstattn.layouts.named",
    "burstattn.partition": "burstattn.layouts.partition",
    "burstattn.partition_cut": "burstattn.layouts.cut",
    "burstattn.partition_solver": "burstattn.masks.partition_solver",
    "burstattn.groups": "burstattn.comm.groups",
    "burstattn.formulas": "burstattn.engine.bytes",
    "burstattn.infer.formulas": "burstattn.infer.bytes",
    "burstattn.recurrent.formulas": "burstattn.recurrent.bytes",
    "burstattn.options": "burstattn.call.options",
    "burstattn.validate": "burstattn.call.validate",
    "burstattn.boundary": "burstattn.call.boundary",
    "burstattn.passes": "burstattn.call.engine_adapter",
    "burstattn.autograd": "burstattn.call.engine_adapter",
    "burstattn.strategies.op": "burstattn.call.prepare",
    "burstattn.strategies.head_chunks": "burstattn.models.head_chunks",
    "burstattn.bench.memory": "burstattn.meter.memory",
    "burstattn.bench.timing": "burstattn.meter.timing",
    "burstattn.bench.progress": "burstattn.meter.progress",
    "burstattn.bench.demo": "burstattn.cli.demo_run",
    "burstattn.bench.generate_run": "burstattn.cli.generate_run",
    "burstattn.engine.passes": "burstattn.engine.compute",
    "burstattn.sim.passes": "burstattn.sim.attn_timeline",
    "burstattn.hf.mixers": "burstattn.hf.survey",
    "burstattn.hf.mixer_table": "burstattn.hf.hybrid_mixers",
    # names that left a module
    "burstattn.config.Call": "burstattn.call.Call",
    "burstattn.config.AttnConfig": "burstattn.call.Call",
    "burstattn.config.RUNTIME": "burstattn.call.call.RUNTIME",
    "burstattn.config.SPEC_FIELDS": "burstattn.call.boundary.SPEC_FIELDS",
    "burstattn.config.encode_spec": "burstattn.call.boundary.encode_spec",
    "burstattn.config.decode_spec": "burstattn.call.boundary.decode_spec",
    "burstattn.config.literal": "repr (the op's spec is the repr of a tuple: burstattn.call.boundary.encode_spec)",
    "burstattn.config.SPECS": "burstattn.call.boundary.decode_spec (memoized with functools.lru_cache)",
    "burstattn.config.LruCache": "burstattn.comm.host.LruCache",
    "burstattn.config.host_side": "burstattn.comm.host.host_side",
    "burstattn.strategies.op.EagerCall": "burstattn.ops.EagerCall",
    "burstattn.strategies.op.run_call": "burstattn.ops.run_call",
    "burstattn.strategies.op.strategy_call": "burstattn.ops.strategy_call",
    "burstattn.bench.train_memory.sim_config": "burstattn.sim.from_train.sim_config",
    "burstattn.models.IGNORE": "burstattn.config.IGNORE_INDEX",
    "burstattn.models.blockwise.IGNORE": "burstattn.config.IGNORE_INDEX",
    "burstattn.parallel.IGNORE": "burstattn.config.IGNORE_INDEX",
    "burstattn.parallel.loss.IGNORE": "burstattn.config.IGNORE_INDEX",
    "burstattn.hf.BurstOptions": "burstattn.hf.Registration",
    "burstattn.hf.attention.BurstOptions": "burstattn.hf.attention.Registration",
    "burstattn.hf.attention.registered_options": "burstattn.hf.families.registration",
    "burstattn.hf.families.registered_options": "burstattn.hf.families.registration",
    "burstattn.train.checks.Plan": "burstattn.train.checks.ParallelPlan",
    # outside the package, or gone: refused with the spelling that replaces them
    "burstattn.bench": f"bench ({_CHECKOUT})",
    "burstattn.cluster": f"bench.cluster ({_CHECKOUT})",
    "burstattn.cli.bench": f"bench.cli ({_CHECKOUT})",
    "burstattn.cli.bench_hf": f"bench.cli_hf ({_CHECKOUT})",
    "burstattn.cli.cluster": f"bench.cluster.cli ({_CHECKOUT})",
    "burstattn.groups.usp_mesh": ('init_device_mesh(device_type, (ring_degree, ulysses_degree), '
                                  'mesh_dim_names=("ring", "ulysses")) from torch.distributed.device_mesh'),
    "burstattn.ops.OpSpec": "burstattn.call.Call (a call is one Call, encoded for the op by burstattn.call.boundary)",
}
"""Every moved name, by its old spelling (a module or a module's name): a ``burstattn.`` path resolves
to its new home (imports and attribute reads of the old spelling keep working, with a
``DeprecationWarning`` naming the new spelling); any other spelling (outside the package, or a sentence)
is raised as the way to write it now. A module's entry covers its names and submodules too
(``burstattn.bench.core`` -> ``bench.core``). The one mechanism: a module a name left answers through
:func:`moved_attribute` (its ``__getattr__``), an old module path through the finder below."""


def _new_spelling(old: str):
    """The new spelling of ``old`` by its longest entry in :data:`MOVED`, or ``None`` (not moved)."""
    parts = old.split(".")
    for i in range(len(parts), 1, -1):
        new = MOVED.get(".".join(parts[:i]))
        if new is not None:
            rest = parts[i:]
            if rest and " (" in new:  # a module outside the package: its submodule or name there
                head, note = new.split(" (", 1)
                return f"{'.'.join([head, *rest])} ({note}"
            return ".".join([new, *rest])
    return None


def _resolves(spelling: str) -> bool:
    return spelling.startswith("burstattn.") and " " not in spelling


def _resolve(spelling: str):
    """The module or the module's name that ``spelling`` (a dotted ``burstattn.`` path) names."""
    try:
        return importlib.import_module(spelling)
    except ModuleNotFoundError as e:
        if e.name != spelling:
            raise
    module, name = spelling.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _is_module(spelling: str) -> bool:
    try:
        return importlib.util.find_spec(spelling) is not None
    except ModuleNotFoundError:  # its parent is a module, not a package
        return False


def _deprecated(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"{old} moved: now {new}", DeprecationWarning, stacklevel=stacklevel + 1)


def moved_attribute(module: str, name: str):
    """``module.name`` for a name that left ``module`` (a module's ``__getattr__`` asks here): its new home's
    value (with a ``DeprecationWarning`` naming it); ``ImportError`` naming the new spelling for one outside
    the package; ``AttributeError`` else."""
    new = MOVED.get(f"{module}.{name}")
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    if _resolves(new):
        _deprecated(f"{module}.{name}", new, 3)  # the caller of the module's __getattr__
        return _resolve(new)
    raise ImportError(f"{module}.{name} moved: now {new}", name=module)


class _OldModule(types.ModuleType):
    """What an old module path imports as: every name read from its new home (:data:`MOVED`)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        new = _new_spelling(f"{self.__name__}.{name}")
        if new is None or not _resolves(new):
            raise ImportError(f"{self.__name__}.{name} moved: now {new}", name=self.__name__)
        value = _resolve(new)
        setattr(self, name, value)
        return value


class _MovedFinder:
    """The finder of old module paths (after the path finder in ``sys.meta_path``: a module that exists wins)."""

    @staticmethod
    def find_spec(fullname: str, path=None, target=None):
        if not fullname.startswith(f"{__name__}."):
            return None
        new = _new_spelling(fullname)
        if new is None or (_resolves(new) and not _is_module(new)):
            return None  # not moved, or a name (``from OLD_MODULE import NAME`` reads it from the module)
        # an old package with resolving entries below it (burstattn.bench: its meters) stays importable
        package = not _resolves(new) and any(k.startswith(fullname + ".") and _resolves(v) for k, v in MOVED.items())
        return ModuleSpec(fullname, _MovedFinder, is_package=package)

    @staticmethod
    def create_module(spec):
        return _OldModule(spec.name)

    @staticmethod
    def exec_module(module) -> None:
        new = _new_spelling(module.__name__)
        if _resolves(new):
            _deprecated(module.__name__, new, 2)  # warnings skips importlib's own frames: the importer
        elif not hasattr(module, "__path__"):
            raise ModuleNotFoundError(f"{module.__name__} moved: now {new}", name=module.__name__)


def _install() -> None:
    """Put the finder right after the standard path finder: a module that exists wins, an old path is
    answered here before any other finder (an editable install's) looks for a file of that name."""
    if any(getattr(f, "__name__", None) == "_MovedFinder" for f in sys.meta_path):
        return
    from importlib.machinery import PathFinder

    at = sys.meta_path.index(PathFinder) + 1 if PathFinder in sys.meta_path else len(sys.meta_path)
    sys.meta_path.insert(at, _MovedFinder)


_install()


def __getattr__(name: str):
    """Import a public name (or a submodule, e.g. ``burstattn.ops``) on first use."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    else:
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}" or f"{__name__}.{name}" in MOVED:
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .api import BurstAttention, burst_attn_func  # noqa: F401
    from .call.options import BurstOptions  # noqa: F401
    from .comm.groups import two_level_groups  # noqa: F401
    from .comm.stats import CommStats, comm_stats  # noqa: F401
    from .comm.trace import StepTrace, trace_steps  # noqa: F401
    from .engine.bytes import ring_bytes  # noqa: F401
    from .layouts.named import gather_sequence, sequence_positions, shard_sequence  # noqa: F401
    from .layouts.partition import Partition, document_partition  # noqa: F401
    from .masks import AttnMask  # noqa: F401
    from .masks.partition_solver import mask_partition  # noqa: F401
    from .strategies import attention  # noqa: F401
