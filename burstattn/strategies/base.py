"""What a strategy is: a differentiable function over sharded q/k/v plus what it accepts."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class StrategySpec:
    """One way of distributing attention.

    Attributes:
        name: the ``strategy=`` value.
        module: module (under ``burstattn.strategies``) holding ``run``; imported on first use.
        layouts: sequence layouts it accepts; ``default_layout`` is used when ``layout=None``.
        options: the extra keyword options it takes (anything else is an error).
        summary: one line for error messages and docs.
    """

    name: str
    module: str
    layouts: tuple[str, ...]
    default_layout: str
    options: tuple[str, ...]
    summary: str

    def runner(self) -> Callable:
        """``run(q, k, v, *, group, causal, softmax_scale, layout, **options) -> out``."""
        from importlib import import_module
        return import_module(f"burstattn.strategies.{self.module}").run
