"""Accelerate's view of a process group started without torchrun (the ranks of
:class:`~burstattn.testing.launch.LocalPool`): for the tests and the Hugging Face benchmark that run a
``transformers.Trainer`` on local ranks (moved here from ``burstattn.hf.trainer``: a harness's helper,
not the integration's)."""
from __future__ import annotations


def local_group_environment(rank: int, world_size: int) -> None:
    """Make accelerate (and so the Trainer) see a process group that was started without torchrun, e.g. by
    :class:`burstattn.testing.launch.LocalPool`: the ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` variables torchrun
    would set (``LOCAL_RANK`` left out at world size 1: a plain single process), and accelerate's cached
    state reset, so that a process can run several Trainers one after another."""
    import os

    from accelerate.state import AcceleratorState, GradientState, PartialState

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    if world_size > 1:
        os.environ["LOCAL_RANK"] = str(rank)
    else:
        os.environ.pop("LOCAL_RANK", None)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
