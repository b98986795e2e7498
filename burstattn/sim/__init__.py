"""Cluster simulator and planner: predict every strategy on 8 to 1,024 devices before renting them.

* :mod:`.hardware`: cluster specs and the presets (``a100-pcie-roce``, ``a100-nvlink-ib``,
  ``h100-nvlink-ib``, ``h200-nvlink-ib``, ``tpuv4``), every figure with its source;
* :mod:`.net`: link and collective cost models;
* :mod:`.plans`: the one adapter to the library's plan functions and byte formulas;
* :mod:`.attention`, :mod:`.direct`: one attention layer's event-level timeline per strategy (ring
  loops, direct schedules, collectives), built of :mod:`.attn_timeline`'s parts (shape, pass, kernel cost);
* :mod:`.memory`, :mod:`.step`: the whole model's step (:func:`simulate`), memory per device;
* :mod:`.planner`: ranking and longest sequence; :mod:`.timeline`: the Gantt chart;
* :mod:`.calibrate`: this machine as a spec; :mod:`.validation`: the measured and published checks.

Nothing here is imported by ``import burstattn``.
"""
from importlib import import_module

__all__ = ["PRESETS", "ClusterHW", "preset", "SimConfig", "SimResult", "simulate"]
_HOME = {"PRESETS": "hardware", "ClusterHW": "hardware", "preset": "hardware", "SimConfig": "step",
         "SimResult": "step", "simulate": "step"}


def __getattr__(name: str):
    """The public names, imported on first use (``burstattn --help`` stays light)."""
    if name in _HOME:
        return getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
