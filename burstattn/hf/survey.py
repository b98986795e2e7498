"""What a transformers model CONTAINS that mixes the sequence: the survey :func:`check_model` refuses from.

Under sequence parallelism every rank runs the model on its own shard of the tokens. Attention that
dispatches through transformers' ``ALL_ATTENTION_FUNCTIONS`` reaches burstattn and sees every shard; any
other layer that mixes positions (a causal convolution, an SSM / Mamba scan, linear attention, a
recurrence, an attention of the model's own) would run on the local shard alone: a silently wrong result.

The survey classifies every module of the model by what it is, not by its family's name:

* ``attention``: its ``forward`` looks up ``ALL_ATTENTION_FUNCTIONS`` (read from the function's code);
* ``container``: ``ModuleList`` / ``Sequential`` / ``ModuleDict``, a ``PreTrainedModel``, or a layer /
  block (``GradientCheckpointingLayer``, a ``*Layer`` / ``*Block`` class) holding no parameter of its own:
  its children are surveyed;
* ``position-wise``: linear maps, embeddings, norms, activations, dropout, rotary embeddings, MLPs and
  mixtures of experts (routers, experts): each position on its own (their children are surveyed too);
* ``sequence mixer``: convolutions, recurrent cells, padding and pooling layers, batch / group / instance
  norms, ``nn.MultiheadAttention`` and attention-like classes that do not dispatch (linear attention);
* anything else is ``unclassified`` and refused as well, with its class name: a new family's mixer
  (``Lfm2ShortConv``, ``BambaMixer``, ``RecurrentGemmaRglru``...) is refused the day it appears.

A mixer or an unclassified module is reported once (its children are not surveyed further). A class
named in ``supported`` (a class or its name: the table of mixers another package makes sequence
parallel) is accepted as a whole.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Iterable

from torch import nn

from .hybrid_mixers import PATCHED

# torch.nn layers that treat every position on its own
_POSITIONWISE_TORCH = (nn.Linear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.RMSNorm,
                       nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.AlphaDropout, nn.Identity, nn.Flatten, nn.Unflatten)
# torch.nn layers that mix positions (in a [B, C, L] or [L, B, C] sequence layout), with what they are
_MIXERS_TORCH = {"torch.nn.modules.conv": "a convolution", "torch.nn.modules.rnn": "a recurrent layer",
                 "torch.nn.modules.padding": "padding", "torch.nn.modules.pooling": "pooling",
                 "torch.nn.modules.batchnorm": "a batch norm", "torch.nn.modules.instancenorm": "an instance norm"}
_CONTAINERS_TORCH = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)
# the roles of transformers' own position-wise classes, by the end of their name
_POSITIONWISE_NAME = re.compile(r"(Norm|NormGated|NormPerHead|RMSNormGated|RotaryEmbedding|Embedding|Embeddings|"
                                r"MLP|Mlp|FeedForward|FFN|Ffn|Expert|Experts|MoE|Moe|MoeBlock|SparseMoeBlock|"
                                r"Router|TopKRouter|TopkRouter|Gate|Gelu|GELU|Activation|Act|Dropout|Linear|Head)$")
_CONTAINER_NAME = re.compile(r"(Layer|Block|Stack|Encoder|Decoder)$")
_ATTENTION_NAME = re.compile(r"Attention|Attn")


@dataclass(frozen=True)
class SequenceMixer:
    """One module the survey refuses: ``path`` (``model.named_modules()`` name), ``cls`` (class name) and
    ``kind`` (what it is: ``"a convolution"``, ``"attention outside the interface"``, ``"unclassified"``...)."""

    path: str
    cls: str
    kind: str

    def __str__(self) -> str:
        return f"{self.cls} at {self.path or '<root>'} ({self.kind})"


@dataclass
class Survey:
    """The survey of a model: ``attention`` lists ``(path, module)`` of every module that dispatches
    through ``ALL_ATTENTION_FUNCTIONS``; ``mixers`` every :class:`SequenceMixer`; ``supported`` the
    ``(path, class name)`` of the mixers accepted through ``supported``."""

    attention: list = field(default_factory=list)
    mixers: list = field(default_factory=list)
    supported: list = field(default_factory=list)


def dispatches(module: nn.Module) -> bool:
    """Whether ``module``'s ``forward`` looks up transformers' ``ALL_ATTENTION_FUNCTIONS`` (so that the
    registered ``attn_implementation`` computes its attention)."""
    fn = inspect.unwrap(type(module).forward)
    code = getattr(fn, "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def _own_parameters(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values())


def _is_transformers(obj, name: str) -> bool:
    return any(c.__module__.startswith("transformers") and c.__name__ == name for c in type(obj).__mro__)


def classify(module: nn.Module, supported: frozenset = frozenset()) -> tuple[str, str]:
    """``(role, kind)`` of one module: role one of ``"supported"``, ``"attention"``, ``"container"``,
    ``"position-wise"``, ``"mixer"``; ``kind`` says what a mixer is (``"unclassified"`` when the survey
    cannot tell)."""
    cls = type(module)
    if cls in supported or cls.__name__ in supported or module.__dict__.get(PATCHED):  # PATCHED: hf.patch_mixers
        return "supported", ""
    if dispatches(module):
        return "attention", ""
    for base in cls.__mro__:
        if base.__module__ in _MIXERS_TORCH:
            return "mixer", _MIXERS_TORCH[base.__module__]
    if isinstance(module, (nn.GroupNorm, nn.MultiheadAttention)):
        return "mixer", "a group norm" if isinstance(module, nn.GroupNorm) else "attention outside the interface"
    if isinstance(module, _POSITIONWISE_TORCH) or cls.__module__.startswith(("torch.nn.modules.activation",
                                                                             "transformers.activations")):
        return "position-wise", ""
    if isinstance(module, _CONTAINERS_TORCH) or _is_transformers(module, "PreTrainedModel"):
        return "container", ""
    name = cls.__name__
    if (_is_transformers(module, "GradientCheckpointingLayer") or _CONTAINER_NAME.search(name)) \
            and not _own_parameters(module):
        return "container", ""
    if _ATTENTION_NAME.search(name) and not _POSITIONWISE_NAME.search(name):
        return "mixer", "attention that does not dispatch through the interface"
    if _POSITIONWISE_NAME.search(name):
        return "position-wise", ""
    return "mixer", "unclassified: neither attention through the interface nor a position-wise layer"


def survey(model: nn.Module, supported: Iterable = ()) -> Survey:
    """Classify every module of ``model`` (see the module docstring); a mixer's children are not surveyed."""
    table = frozenset(supported)
    out = Survey()
    stack = [("", model)]
    while stack:
        path, module = stack.pop()
        role, kind = classify(module, table)
        if role == "supported":
            out.supported.append((path, type(module).__name__))
            continue
        if role == "mixer":
            out.mixers.append(SequenceMixer(path, type(module).__name__, kind))
            continue
        if role == "attention":
            out.attention.append((path, module))
        children = [(f"{path}.{n}" if path else n, m) for n, m in module.named_children()]
        stack.extend(reversed(children))
    out.mixers.sort(key=lambda m: m.path)
    return out


def sequence_mixers(model: nn.Module, supported_mixers: Iterable = ()) -> list:
    """Every module of ``model`` that would mix the sequence outside the registered attention (a
    :class:`SequenceMixer` list, in module order): what :func:`burstattn.hf.check_model` refuses.
    ``supported_mixers``: classes (or class names) accepted as a whole."""
    return survey(model, supported_mixers).mixers


__all__ = ["SequenceMixer", "Survey", "classify", "dispatches", "sequence_mixers", "survey"]

