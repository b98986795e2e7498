"""The fixed cost of one blockwise chunk on this machine (a short microbenchmark).

The same training forward + backward of a model (default ``tiny``: 2 layers, dim 64, vocabulary
256, one process, one thread, full checkpointing) over ``rows`` tokens, whole and in chunks of
``chunk`` tokens (MLP and loss alike): the FLOPs are the same, so the difference is what the extra
chunks cost (kernel launches, dispatch, autograd nodes, the small weights read again). Steps
alternate between the two arms (contention hits both alike) and each is timed in the thread's CPU
time (``time.thread_time``: another process's load does not enter); the figure is the difference of
the medians over the extra chunks. ``burstattn sim calibrate`` stores it as the spec's
``chunk_overhead_s`` (docs/simulation.md, "Blockwise chunks").
"""
from __future__ import annotations

import statistics
import time

import torch


def measure_chunk_cost(rows: int = 1024, chunk: int = 16, repeats: int = 9, model: str = "tiny") -> dict:
    """``{"chunk_overhead_s", "whole_s", "chunked_s", "extra_chunks", "rows", "chunk", "repeats"}``:
    seconds per extra chunk, and the medians behind it. Raises ``ValueError`` unless
    ``0 < chunk < rows`` and ``repeats >= 1``."""
    from ..models import preset
    from ..models.blockwise import chunk_bounds
    from ..models.llama import Llama

    if not 0 < chunk < rows or repeats < 1:
        raise ValueError(f"measure_chunk_cost: need 0 < chunk < rows and repeats >= 1, got chunk {chunk}, rows "
                         f"{rows}, repeats {repeats}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = preset(model)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (1, rows), generator=gen)
        labels = torch.randint(0, cfg.vocab_size, (1, rows), generator=gen)
        positions = torch.arange(rows)
        whole = Llama(cfg, checkpointing="full")
        chunked = Llama(cfg.with_overrides(mlp_chunk=chunk, loss_chunk=chunk), checkpointing="full")
        chunked.load_state_dict(whole.state_dict())

        def step(m) -> float:
            t0 = time.thread_time()
            m(tokens, positions, labels=labels, total_targets=rows).loss.backward()
            return time.thread_time() - t0

        samples = {"whole": [], "chunked": []}
        for m in (whole, chunked):  # warm-up: first calls, allocations
            step(m)
        for _ in range(repeats):
            samples["whole"].append(step(whole))
            samples["chunked"].append(step(chunked))
    finally:
        torch.set_num_threads(threads)
    extra = (cfg.n_layers + 1) * (len(chunk_bounds(rows, chunk)) - 1)  # every layer's MLP and the loss
    a, b = statistics.median(samples["whole"]), statistics.median(samples["chunked"])
    return {"chunk_overhead_s": max(0.0, b - a) / extra, "whole_s": a, "chunked_s": b, "extra_chunks": extra,
            "rows": rows, "chunk": chunk, "repeats": repeats}
