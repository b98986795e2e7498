"""The simulator's vocabulary and its units (no imports: the command line's parser reads it without
loading the simulator)."""

STRATEGIES = ("burst", "ring", "rsa", "ulysses", "allgather", "usp", "tp", "tp-v1", "tp-v3")
MODES = ("train", "prefill", "decode")
CHECKPOINTING = ("none", "full", "remat")
SCHEDULES = ("ring", "distflash", "double")
OFFLOAD = ("none", "inputs", "all")  # burstattn.models.offload.OFFLOAD (kept equal by a test)


def seconds(x: float) -> str:
    """``x`` seconds in the unit that fits: ``1.23 s``, ``45.6 ms``, ``789 us``, ``12.3 ns``."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x / 1e-9:.3g} ns" if x else "0 s"


def size(nbytes: float) -> str:
    """``nbytes`` in the binary unit that fits: ``24.9 GiB``, ``3.1 MiB``, ``740 KiB``, ``12 B``."""
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if abs(nbytes) >= 2 ** shift:
            return f"{nbytes / 2 ** shift:.3g} {unit}"
    return f"{nbytes:.0f} B"


def rate(tokens_per_s: float) -> str:
    """Tokens per second with a metric prefix: ``1.23M``, ``456k``, ``78.9``."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(tokens_per_s) >= scale:
            return f"{tokens_per_s / scale:.3g}{unit}"
    return f"{tokens_per_s:.3g}"
