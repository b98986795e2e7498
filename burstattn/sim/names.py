"""The simulator's vocabulary (no imports: the command line's parser reads it without loading the
simulator)."""

STRATEGIES = ("burst", "ring", "rsa", "ulysses", "allgather", "usp", "tp", "tp-v1", "tp-v3")
MODES = ("train", "prefill", "decode")
CHECKPOINTING = ("none", "full", "remat")
SCHEDULES = ("ring", "distflash", "double")
OFFLOAD = ("none", "inputs", "all")  # burstattn.models.offload.OFFLOAD (kept equal by a test)
