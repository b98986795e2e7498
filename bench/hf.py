"""``burstattn bench hf``: Hugging Face Trainer steps on packed long documents, with and without burstattn.

Three suites, in real local processes (gloo, ranks x threads <= the cores given):

* ``steps``: tokens/s and peak memory per rank of ``transformers.Trainer`` optimizer steps of a small
  Llama (built from a config, random weights) on one packed row of N tokens per replica (documents
  of a long-tailed length mix, ``position_ids`` restarting per document). Contenders:
  ``cp-burst`` / ``cp-ulysses`` (:class:`burstattn.hf.ContextParallelTrainer` at world P, the row
  cut over the P ranks), ``single`` (the plain Trainer on one process with P threads, the same global
  batch), ``ddp`` (the plain Trainer at world P: every rank its own full row, so P rows per step).
  The plain Trainer runs transformers' default ``sdpa`` attention: dense causal work over the row
  (transformers masks the documents but cannot skip their work on CPU). Timed steps follow
  ``warmup`` untimed ones; the figure is the median step, max over ranks.
* ``maxlen``: the longest packed row each contender trains under a per-rank memory budget (one
  measured Trainer step per probe: model, optimizer state and activations; doubling then bisection).
* ``balance``: the causal work per rank (score entries of the block plan, :func:`burstattn.masks.rank_work`)
  of a packed row with the document-balanced partition against the plain zigzag layout, on a seeded
  long-tailed length mix: max/min and max/mean. Pure: no processes.

Peak memory: :func:`burstattn.meter.memory.measure_peak` around one whole Trainer step (``train()`` with
one step, optimizer creation included), allocator events on CPU. Writes ``hf.json`` / ``hf.md``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from burstattn.config import IGNORE_INDEX

SUITES = ("steps", "maxlen", "balance")
CONTENDERS = ("cp-burst", "cp-ulysses", "single", "ddp")


@dataclass(frozen=True)
class HfBenchConfig:
    """Flags of ``burstattn bench hf``."""

    world_size: int = 2
    seq_lens: tuple[int, ...] = (2048, 4096, 8192)
    contenders: tuple[str, ...] = CONTENDERS
    steps: int = 3
    warmup: int = 1
    hidden: int = 256
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 2048
    mean_doc: int = 600
    """Mean document length of the long-tailed mix (lognormal, sigma 1.2, at least 16 tokens)."""
    mem_budget_mib: float = 384.0
    maxlen_start: int = 2048
    maxlen_cap: int = 32768
    granule: int = 1024
    bisect_steps: int = 2
    balance_seq_len: int = 65536
    balance_world_sizes: tuple[int, ...] = (2, 4, 8)
    block_size: int = 512
    suites: tuple[str, ...] = SUITES
    seed: int = 0
    out: str = "bench-out"


def doc_lengths(total: int, mean: int, seed: int) -> list[int]:
    """Document lengths of a packed row of exactly ``total`` tokens: lognormal (sigma 1.2) around
    ``mean``, at least 16 tokens, the last one cut to fit. Deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    sigma = 1.2
    mu = torch.log(torch.tensor(float(mean))) - sigma ** 2 / 2
    out: list[int] = []
    while sum(out) < total:
        out.append(max(16, int(torch.exp(mu + sigma * torch.randn(1, generator=gen)))))
    out[-1] -= sum(out) - total
    return [n for n in out if n > 0]


def packed_rows(cfg: HfBenchConfig, seq_len: int, rows: int) -> list[dict]:
    """``rows`` packed rows of ``seq_len`` tokens: random ids, ``position_ids`` restarting per document,
    labels -100 at each document's first token (as ``DataCollatorWithFlattening`` makes them)."""
    out = []
    for r in range(rows):
        lengths = doc_lengths(seq_len, cfg.mean_doc, cfg.seed + r)
        gen = torch.Generator().manual_seed(cfg.seed + 1000 + r)
        ids = torch.randint(0, cfg.vocab, (seq_len,), generator=gen)
        pos = torch.cat([torch.arange(n) for n in lengths])
        labels = ids.clone()
        labels[pos == 0] = IGNORE_INDEX
        out.append({"input_ids": ids, "position_ids": pos, "labels": labels})
    return out


class RowCollator:
    """Stacks pre-packed rows (batch 1: one packed row per replica and step)."""

    def __call__(self, features: list[dict]) -> dict:
        return {k: torch.stack([f[k] for f in features]) for k in features[0]}


def _model(cfg: HfBenchConfig):
    import transformers as tf

    torch.manual_seed(cfg.seed)
    config = tf.LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=2 * cfg.hidden,
                            num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                            num_key_value_heads=cfg.kv_heads, max_position_embeddings=max(cfg.maxlen_cap, 65536))
    return tf.LlamaForCausalLM(config).float()


def _trainer(cfg: HfBenchConfig, contender: str, seq_len: int, steps: int, out: str, world: int, callbacks=()):
    import transformers as tf

    import burstattn.hf as bhf

    replicas = world if contender == "ddp" else 1
    args = tf.TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=steps, learning_rate=1e-4,
                                logging_steps=max(steps, 1), save_strategy="no", report_to="none", use_cpu=True,
                                ddp_backend="gloo" if world > 1 else None, disable_tqdm=True, seed=cfg.seed)
    kw = dict(model=_model(cfg), args=args, train_dataset=packed_rows(cfg, seq_len, steps * replicas),
              data_collator=RowCollator(), callbacks=list(callbacks))
    if contender.startswith("cp-"):
        return bhf.ContextParallelTrainer(**kw, strategy=contender[3:])
    return tf.Trainer(**kw)


class StepTimer:
    """A TrainerCallback (duck-typed) recording each optimizer step's wall time."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def __getattr__(self, name: str):  # every other callback event: nothing to do
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_step_begin(self, *args, **kwargs) -> None:
        self._t0 = time.perf_counter()

    def on_step_end(self, *args, **kwargs) -> None:
        self.times.append(time.perf_counter() - self._t0)


def trainer_rank(rank: int, world: int, cfg: HfBenchConfig, contender: str, seq_len: int, timed: bool) -> dict:
    """One contender at one length on this rank: step times (``timed``) or the peak of one step."""
    import tempfile

    from burstattn.testing.accelerate_env import local_group_environment
    from burstattn.meter.memory import measure_peak

    local_group_environment(rank, world)
    with tempfile.TemporaryDirectory() as out:
        if timed:
            timer = StepTimer()
            _trainer(cfg, contender, seq_len, cfg.warmup + cfg.steps, out, world, [timer]).train()
            return {"times": timer.times[cfg.warmup:]}
        trainer = _trainer(cfg, contender, seq_len, 1, out, world)
        return {"peak": measure_peak(trainer.train)[1].peak_bytes}


def _pools(cfg: HfBenchConfig, pools) -> dict:
    """``{contender: pool}`` from the driver's :class:`~.driver.Pools`: world P (1 thread per rank) for cp
    and ddp, one process with P threads for single."""
    return {c: pools.get(1, cfg.world_size) if c == "single" else pools.get(cfg.world_size, 1)
            for c in cfg.contenders}


def _run(pool, *args) -> Optional[list[dict]]:
    from burstattn.testing.launch import LocalGroupError

    try:
        return pool.run(trainer_rank, *args)
    except LocalGroupError as e:  # out of memory or a refused length: reported, not fatal
        return [{"error": e.summary}]


def run_steps(cfg: HfBenchConfig, pools: dict, console) -> list[dict]:
    rows = []
    for n in cfg.seq_lens:
        for c in cfg.contenders:
            console.print(f"bench hf: {c} at N={n}")
            timed = _run(pools[c], cfg, c, n, True)
            peaks = _run(pools[c], cfg, c, n, False)
            world = 1 if c == "single" else cfg.world_size
            rows.append(_step_row(c, n, world, cfg, timed, peaks))
    return rows


def _step_row(contender: str, n: int, world: int, cfg: HfBenchConfig, timed, peaks) -> dict:
    row = dict(contender=contender, seq_len=n, world_size=world, threads_per_rank=cfg.world_size // world)
    if any("error" in r for r in timed + peaks):
        return dict(row, error=next(r["error"] for r in timed + peaks if "error" in r))
    step = [max(r["times"][i] for r in timed) for i in range(cfg.steps)]
    median = sorted(step)[len(step) // 2]
    tokens = n * (cfg.world_size if contender == "ddp" else 1)
    return dict(row, tokens_per_step=tokens, step_s=step, median_step_s=median, tokens_per_s=tokens / median,
                peak_mem_bytes=[r["peak"] for r in peaks])


def run_maxlen(cfg: HfBenchConfig, pools: dict, console) -> list[dict]:
    from bench.maxlen import search_longest

    budget = cfg.mem_budget_mib * 2**20
    out = []
    for c in cfg.contenders:
        probes: list[tuple[int, Optional[int]]] = []

        def fits(n: int, c=c, probes=probes) -> bool:
            console.print(f"bench hf maxlen: {c} at N={n}")
            res = _run(pools[c], cfg, c, n, False)
            peak = None if any("error" in r for r in res) else max(r["peak"] for r in res)
            probes.append((n, peak))
            return peak is not None and peak <= budget

        longest, note = search_longest(fits, start=cfg.maxlen_start, cap=cfg.maxlen_cap, granule=cfg.granule,
                                       bisect_steps=cfg.bisect_steps)
        out.append(dict(contender=c, longest=longest, note=note, probes=probes,
                        peak_at_longest=next((p for n, p in probes if n == longest), None)))
    return out


def run_balance(cfg: HfBenchConfig) -> list[dict]:
    """Causal work per rank, document partition vs zigzag, on a seeded long-tailed packed row."""
    from burstattn.masks import AttnMask, rank_work
    from burstattn.layouts.partition import document_partition, layout_positions, token_work

    n = cfg.balance_seq_len
    lengths = doc_lengths(n, cfg.mean_doc, cfg.seed)
    cu = torch.cumsum(torch.tensor([0] + lengths), 0)
    mask = AttnMask(cu_seqlens=cu, block_size=cfg.block_size)
    pairs = token_work(n, causal=True, cu_seqlens=cu)  # keys each token sees: the exact causal work
    rows = []
    for p in cfg.balance_world_sizes:
        for name, layout in (("zigzag", "zigzag"), ("documents", document_partition(cu, p, causal=True))):
            blocks = rank_work(mask, True, n, p, layout)  # what the engine's block plan computes
            exact = [float(pairs[pos].sum()) for pos in layout_positions(layout, n, p)]
            rows.append(dict(world_size=p, layout=name, work=blocks, exact=exact,
                             max_over_min=max(blocks) / max(min(blocks), 1.0),
                             max_over_mean=max(blocks) / (sum(blocks) / len(blocks)),
                             exact_max_over_min=max(exact) / max(min(exact), 1.0),
                             exact_max_over_mean=max(exact) / (sum(exact) / len(exact))))
    return [dict(seq_len=cfg.balance_seq_len, documents=len(lengths), longest_doc=max(lengths),
                 median_doc=sorted(lengths)[len(lengths) // 2], rows=rows)]


def run_hf_bench(cfg: HfBenchConfig, docs: Optional[str] = None, console=None) -> dict:
    """Run the suites of ``cfg``; write ``hf.json`` and ``hf.md`` (and the tables into ``docs``, between
    its bench hf markers); return the document."""
    from rich.console import Console

    from bench.driver import Pools, Started, document, publish
    from bench.hf_report import hf_markdown, replace_section

    console = console or Console(stderr=True)
    started = Started.now()
    steps, maxlen, balance = [], [], []
    if "balance" in cfg.suites:
        balance = run_balance(cfg)
    if {"steps", "maxlen"} & set(cfg.suites):
        with Pools(timeout_s=3600.0, pg_timeout_s=600.0) as made:
            pools = _pools(cfg, made)
            if "steps" in cfg.suites:
                steps = run_steps(cfg, pools, console)
            if "maxlen" in cfg.suites:
                maxlen = run_maxlen(cfg, pools, console)
    doc = document("hf", cfg, started, steps=steps, maxlen=maxlen, balance=balance)
    publish(cfg.out, "hf", doc, hf_markdown(doc), docs, replace_section)
    return doc
