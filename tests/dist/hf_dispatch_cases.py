"""Rank-side functions of tests/dist/test_hf_dispatch.py: ``ContextParallelTrainer(dispatch="dynamic")``
against ``dispatch="static"`` and world 1 (module-level so they pickle by reference)."""
from __future__ import annotations

import tempfile
from dataclasses import replace

from tests.dist import hf_trainer_cases as tc
from tests.dist.hf_cases import build

ADAM_EPS = 1e-6  # the dispatch tests' (tests/dist/test_dispatch.py): Adam's first steps ~ lr * sign(g) at 1e-8


def _trainer(rank: int, world: int, case: tc.TrainerCase, out: str, dispatch: str, dataset=None, **kw):
    import transformers as tf

    import burstattn.hf as bhf

    tc._reset_accelerate(rank, world)
    args = tc._args(case, out, case.per_device, "gloo" if world > 1 else None)
    args.adam_epsilon = ADAM_EPS
    collate = tf.DataCollatorWithFlattening() if case.data == "packed" else tc.PadCollator(case.data)
    return bhf.ContextParallelTrainer(model=build(case.kind, case.seed).train(), args=args, data_collator=collate,
                                      train_dataset=tc.dataset(case) if dataset is None else dataset,
                                      strategy=case.strategy, backend="reference", dispatch=dispatch, **kw)


def train(rank: int, world: int, runs: list) -> list[dict]:
    """Each ``(case, dispatch, dynamic's budget or None)``'s 3 steps on this pool: logged losses and grad norms, final parameters,
    the evaluation loss and (dynamic) the last step's sequences per degree."""
    out = []
    for case, dispatch, budget in runs:
        case = replace(case, world=world, cp=world)
        with tempfile.TemporaryDirectory() as d:
            trainer = _trainer(rank, world, case, d, dispatch, **({"dispatch_budget": budget} if budget else {}))
            trainer.train()
            res = tc._result(trainer, trainer.model)
            res["eval_loss"] = trainer.evaluate(tc.dataset(case)[:4])["eval_loss"]
            plan = trainer.dispatcher.last_plan if trainer.dispatcher else None
            res["degrees"] = None if plan is None else plan.degrees
        out.append(res)
    return out


def refusal(rank: int, world: int, what: str) -> str:
    """A refused dynamic configuration or batch: the message on this rank ("no error" if none)."""
    case = tc.TrainerCase(world=world, cp=world)
    with tempfile.TemporaryDirectory() as d:
        try:
            if what == "differing":  # rank 1 holds other tokens: refused at dispatch time, every rank
                data = tc.dataset(replace(case, seed=case.seed + (rank == 1)))
                _trainer(rank, world, case, d, "dynamic", dataset=data).train()
            elif what == "cp_size":
                _trainer(rank, world, case, d, "dynamic", cp_size=world)
            elif what == "strategy":
                _trainer(rank, world, replace(case, strategy="ulysses"), d, "dynamic")
            elif what == "mode":
                _trainer(rank, world, case, d, "adaptive")
            elif what == "budget":  # a document of 38 tokens over 2 ranks of 8
                _trainer(rank, world, case, d, "dynamic", dispatch_budget=8).train()
            else:
                raise AssertionError(what)
        except ValueError as e:
            return str(e)
    return "no error"

