"""The :class:`~burstattn.call.Call` across the custom op's boundary, generically.

A custom op takes tensors, numbers and strings, not a dataclass. :func:`op_arguments` writes every spec
field of the call (:data:`~burstattn.call.boundary.SPEC_FIELDS`), in field order, as one tuple of plain values
(None, bool, int, float, str and tuples of those) and passes its ``repr`` as the op's constant ``spec``
string; :func:`call_from` reads it back with :func:`ast.literal_eval`, once per distinct spec
(:func:`decode_spec` is memoized: a model's layers repeat one spec). ``repr`` writes a lossless literal of
any string (quotes, separators, line ends, any code point), so there is no escape table and no field is
named here. The few typed values go through one codec per value *type* (a field says which in its
``metadata["codec"]``):

* ``"group"``: a :class:`~burstattn.comm.groups.GroupContext` by its process group's name (``""``: a world of one);
* ``"layout"``: a layout name as it is; a :class:`~burstattn.layouts.partition.Partition` as ``("partition", name)``
  and its positions ``[P, n]`` (int64) as one tensor;
* ``"mask"``: an :class:`~burstattn.AttnMask` as ``(window, block_size, documents, key documents)`` and
  its document bounds ``[D + 1]`` (and the keys' ``[D + 1]``) as tensors. The op finds the mask *object*
  again by that definition (:func:`burstattn.masks.setup.data_mask`): the user's own, registered when
  the call is encoded, so the block summaries it caches serve every later call of the same shape;
* ``"topology"``: a :class:`~burstattn.comm.groups.TwoLevelGroups` as ``(inner name, outer name, ranks_per_node,
  nodes)``.

The runtime fields (ALiBi slopes and sinks, tensor arguments of the op of their own; the mask plan,
derived by the check) are not encoded. A ``mask_mod`` (a Python function) cannot cross: such calls run
the eager fallback (:class:`burstattn.ops.EagerCall`).
"""
from __future__ import annotations

import ast
import functools
from dataclasses import fields
from typing import Iterator, Optional

import torch

from ..comm.groups import GroupContext, TwoLevelGroups, group_name, named_context, resolve_group
from ..masks.setup import data_mask, register_mask
from .call import Call

__all__ = ["op_arguments", "call_from", "shapes_call"]

SPEC_FIELDS = tuple((f.name, f.metadata.get("codec")) for f in fields(Call) if not f.metadata.get("runtime"))
"""``(name, codec or None)`` of every field of :class:`Call` that its spec holds (all but the runtime
ones), in order: plain tuples, which the compiler iterates as constants."""


SPEC_NAMES = tuple(name for name, _ in SPEC_FIELDS)
STRATEGY_AT, WHERE_AT = (SPEC_NAMES.index(f) for f in ("strategy", "where"))
"""The places of the strategy and the group in a decoded spec (``decode_spec(spec)[STRATEGY_AT]``)."""
TYPED = tuple((i, codec) for i, (_, codec) in enumerate(SPEC_FIELDS) if codec)
"""``(place, codec)`` of the typed fields: the only values a codec touches (a plain value crosses as it is)."""



def encode_spec(values: tuple) -> str:
    """The op's ``spec`` of the plain ``values`` of :data:`SPEC_FIELDS` (in that order): their tuple's ``repr``,
    a Python literal that :func:`decode_spec` turns back into the same values. Plain string formatting of
    constants, which the compiler folds to a constant (it cannot trace ``json``)."""
    return repr(values)


@functools.lru_cache(maxsize=64)
def decode_spec(text: str) -> tuple:
    """The values of :func:`encode_spec` (a tuple in :data:`SPEC_FIELDS` order; lists, had any been encoded,
    come back as tuples). Every forward and backward of the op decodes its spec and a model's layers
    repeat one spec: parsed once per distinct text (``ast.literal_eval``, ~50 us), the same tuple after."""
    return _tupled(ast.literal_eval(text))


def _tupled(x):
    return tuple(_tupled(e) for e in x) if isinstance(x, (list, tuple)) else x


ALONE = GroupContext(None, 0, 1)  # a world of one without torch.distributed (group name "")


def _group_out(where: Optional[GroupContext], tensors: list):
    if where is not None and where.group is None:
        return ""  # a world of one without torch.distributed
    return group_name(None if where is None else where.group)


def _group_in(name: str, tensors: Iterator) -> GroupContext:
    return named_context(name) if name else ALONE


def _layout_out(layout, tensors: list):
    if layout is None or isinstance(layout, str):
        return layout
    tensors.append(torch.stack(list(layout.positions)))  # [P, n] int64
    return ("partition", layout.name)  # a pair: no layout name can be mistaken for it


def _layout_in(value, tensors: Iterator):
    if value is None or isinstance(value, str):
        return value
    from ..layouts.partition import Partition

    return Partition(tuple(next(tensors).cpu().unbind(0)), name=value[1])


def _mask_out(mask, tensors: list):
    if mask is None:
        return None
    if mask.mask_mod is not None:
        raise ValueError("a mask with a mask_mod cannot be an op argument (it runs the eager fallback)")
    if not torch.compiler.is_compiling():  # reading the bounds' values is host work the compiler cannot trace
        register_mask(mask)
    for b in (mask.bounds, mask.kv_bounds):
        if b is not None:
            tensors.append(b)
    return mask.window, mask.block_size, mask.bounds is not None, mask.kv_bounds is not None


def _mask_in(value, tensors: Iterator):
    if value is None:
        return None
    window, block_size, documents, key_documents = value
    bounds = next(tensors) if documents else None
    kv_bounds = next(tensors) if key_documents else None
    return data_mask(window, bounds, block_size, kv_bounds)


def _topology_out(topo, tensors: list):
    if topo is None:
        return None
    return group_name(topo.inner_group), group_name(topo.outer_group), topo.ranks_per_node, topo.nodes


def _topology_in(value, tensors: Iterator):
    if value is None:
        return None
    inner, outer, per_node, nodes = value
    return TwoLevelGroups(resolve_group(inner), resolve_group(outer), per_node, nodes)


# value type -> (to the op: (value, tensors out) -> plain value, from the op: (plain value, tensors in) -> value)
CODECS = {"group": (_group_out, _group_in), "layout": (_layout_out, _layout_in),
          "mask": (_mask_out, _mask_in), "topology": (_topology_out, _topology_in)}


def op_arguments(call: Call) -> tuple[str, list[torch.Tensor]]:
    """``(spec, tensors)`` of a call: every spec field in the constant ``spec`` string, the typed values'
    tensors (partition positions, document bounds) in ``tensors``, in field order. A typed value that is
    plain already (``None``, a layout name) skips its codec."""
    tensors: list[torch.Tensor] = []
    values = [getattr(call, name) for name in SPEC_NAMES]  # (not operator.attrgetter: dynamo cannot trace it)
    for i, codec in TYPED:
        value = values[i]  # plain already (None, but a group's; a layout's name): crosses as it is
        if (value is not None or codec == "group") and not (codec == "layout" and isinstance(value, str)):
            values[i] = CODECS[codec][0](value, tensors)
    return encode_spec(tuple(values)), tensors


def call_from(spec: str, tensors: list[torch.Tensor], alibi: Optional[torch.Tensor] = None,
              sinks: Optional[torch.Tensor] = None) -> Call:
    """The inverse of :func:`op_arguments` (with the op's own tensors, ``alibi`` and ``sinks``)."""
    rest, values = iter(tensors), list(decode_spec(spec))
    for i, codec in TYPED:
        value = values[i]
        if (value is not None or codec == "group") and not (codec == "layout" and isinstance(value, str)):
            values[i] = CODECS[codec][1](value, rest)
    return Call(**dict(zip(SPEC_NAMES, values)), alibi=alibi, sinks=sinks)


def shapes_call(spec: str, alibi=None, sinks=None) -> Call:
    """The call's plain fields and group only (for the op's fake implementation: shapes, no mask or
    partition is built from fake tensors)."""
    values = decode_spec(spec)
    plain = {name: value for (name, codec), value in zip(SPEC_FIELDS, values) if codec is None}
    return Call(**plain, where=_group_in(values[WHERE_AT], iter(())), alibi=alibi, sinks=sinks)
