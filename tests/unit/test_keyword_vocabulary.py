"""The keyword vocabulary is written once: the mask keywords are the fields of ``MaskKeywords``, the rare ones
``BurstOptions``', all of them ``Keywords``'; no module lists their names by hand, the front doors and
``prepare`` take the one object, and each strategy's keywords are the vocabulary's groups."""
from __future__ import annotations

import ast
import inspect
import pathlib
from dataclasses import fields

import pytest

import burstattn
from burstattn.call import options, prepare
from burstattn.call.call import Call
from burstattn.masks.spec import MASK_KEYWORDS, MaskKeywords

PACKAGE = pathlib.Path(burstattn.__file__).parent
NAMES = set(options.RARE_KEYWORDS)  # the mask and model keywords' names (what was written out five times)


def _literals(tree):
    """Every tuple / list / set literal of strings and the vocabulary names among them."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            yield node, [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in NAMES]


def test_no_module_lists_the_keyword_names():
    """A hand-written list of three or more mask / model keyword names anywhere in the package is a second
    definition (the dataclass fields are the one): derive it from the fields (``names_in``, ``MASK_KEYWORDS``)."""
    found = [f"{path.relative_to(PACKAGE)}:{node.lineno} {hits}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for node, hits in _literals(ast.parse(path.read_text())) if len(hits) >= 3]
    assert not found, found


def test_the_vocabulary_is_the_dataclasses_fields():
    assert MASK_KEYWORDS == tuple(f.name for f in fields(MaskKeywords))
    assert set(MASK_KEYWORDS) <= set(options.RARE_KEYWORDS) <= set(options.KEYWORDS)
    assert issubclass(options.Keywords, options.BurstOptions) and issubclass(options.BurstOptions, MaskKeywords)
    assert burstattn.BurstOptions is options.BurstOptions
    assert all(options.GROUPS[n] in ("every", "mask", "schedule", "model", "kernel") for n in options.KEYWORDS)


def test_burst_attn_func_signature_is_the_vocabulary():
    """The public signature's keywords are Keywords' common fields with their defaults (plus flash-attn's
    spellings, ``options`` and the rare ones one by one), and BurstAttention's signature is the same."""
    sig = inspect.signature(burstattn.burst_attn_func).parameters
    named = {n: p.default for n, p in sig.items() if n not in ("q", "k", "v", "rare", "options")}
    for name, default in named.items():
        canonical = options.SPELLINGS.get(name, name)
        assert canonical in options.KEYWORDS, name
        assert default is None if name in options.SPELLINGS else default == options.DEFAULTS[canonical], name
    assert set(options.KEYWORDS) - set(options.RARE_KEYWORDS) <= set(named)  # every common keyword is named
    mod = inspect.signature(burstattn.BurstAttention).parameters
    assert list(mod) == [n for n in sig if n not in ("q", "k", "v")]


def test_prepare_and_the_module_take_the_one_object():
    """``prepare`` builds the Call from a Keywords (no keyword of its own per field); BurstAttention's
    ``__init__`` takes ``**keywords`` (its signature is burst_attn_func's)."""
    params = inspect.signature(prepare.prepare).parameters
    assert not set(params) & set(options.KEYWORDS), sorted(set(params) & set(options.KEYWORDS))
    source = inspect.getsource(burstattn.BurstAttention.__init__)
    assert "def __init__(self, **keywords)" in source
    filled = {keyword for _, keyword in prepare.FROM_KEYWORDS}
    assert filled <= set(options.KEYWORDS)
    # every Call field a keyword of the same name describes is filled from it
    assert {f.name for f in fields(Call) if f.name in options.KEYWORDS and f.name != "mask"} <= {
        name for name, _ in prepare.FROM_KEYWORDS}


@pytest.mark.parametrize("strategy", sorted(set(burstattn.strategies.STRATEGIES) - {"burst"}))
def test_strategy_keywords_come_from_the_vocabulary(strategy):
    """burst takes every keyword; the others a subset of the vocabulary plus their own (usp's degrees)."""
    from burstattn.strategies import STRATEGIES

    burst = set(STRATEGIES["burst"].options)
    assert burst == set(options.KEYWORDS) - set(options.names_in("every"))
    own = set(STRATEGIES[strategy].options) - set(options.KEYWORDS)
    assert own <= {"ulysses_degree", "ring_degree", "mesh", "ulysses_group", "ring_group"}, own


def test_single_process_refusal_names_the_strategy():
    import torch

    q, k, v = (torch.randn(1, 8, 2, 8) for _ in range(3))
    with pytest.raises(ValueError, match=r"strategy 'tp' does not support softcap=, window_size="):
        burstattn.attention(q, k, v, strategy="tp", window_size=(2, 0), softcap=3.0)
    with pytest.raises(ValueError, match=r"strategy 'tp' does not support cu_seqlens="):
        burstattn.attention(q, k, v, strategy="tp", options=burstattn.BurstOptions(cu_seqlens=[0, 3, 8]))
    # a keyword at its default asks nothing: every strategy accepts it
    out = burstattn.attention(q, k, v, strategy="tp", dropout_p=0.0, softcap=None, return_lse=False)
    assert torch.equal(out, burstattn.burst_attn_func(q, k, v))
