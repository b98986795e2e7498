"""``burstattn generate``: its flags and the JSON keys it reports (``KEYS``); the same tokens whatever the world size
and strategy (--seed fixes weights and prompt); a save_pretrained directory as --model; bad input
exits with a clear error."""
from __future__ import annotations

import json

import pytest

from burstattn.cli import main

KEYS = {"tokens", "first_token_latency_s", "decode_tokens_per_s", "peak_mem_bytes"}


def _run(capsys, *args) -> dict:
    assert main(["generate", *args, "--json", "--no-warmup"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_same_tokens_any_world_and_strategy(capsys):
    common = ["--model", "tiny", "--prompt-len", "29", "--max-new-tokens", "5", "--seed", "7"]
    one = _run(capsys, *common, "--world-size", "1", "--strategy", "burst", "--no-memory")
    three = _run(capsys, *common, "--world-size", "3", "--strategy", "ring")
    assert KEYS <= set(one) and KEYS <= set(three)
    assert len(one["tokens"]) == 5 and one["tokens"] == three["tokens"]
    assert len(three["peak_mem_bytes"]) == 3 and all(b > 0 for b in three["peak_mem_bytes"])
    assert three["bytes_per_token"] == 2 * 2 * 4 * 17 * 4  # layers x (P-1) x Hq x (D+1) x 4


def test_save_pretrained_directory(capsys, tmp_path):
    pytest.importorskip("transformers", minversion="5")
    from tests.dist.cases.hf_models import build_causal_lm

    build_causal_lm("llama", seed=3).save_pretrained(tmp_path / "m")
    out = _run(capsys, "--model", str(tmp_path / "m"), "--world-size", "1", "--prompt-len", "19",
               "--max-new-tokens", "4", "--no-memory")
    model = build_causal_lm("llama", seed=3)
    model.set_attn_implementation("eager")
    import torch

    prompt = torch.randint(0, model.config.vocab_size, (1, 19), generator=torch.Generator().manual_seed(1))
    ref = model.generate(prompt, max_new_tokens=4, do_sample=False)[0, 19:].tolist()
    assert out["tokens"] == ref


def test_bad_input_exits_with_error(capsys):
    assert main(["generate", "--model", "tiny", "--world-size", "1", "--prompt-len", "0", "--no-memory"]) == 2
    assert "prompt is empty" in capsys.readouterr().err


def test_usp_needs_degrees_and_runs_with_them(capsys):
    """--strategy usp takes --ulysses-degree / --ring-degree (refused without)."""
    common = ["--model", "tiny", "--prompt-len", "24", "--max-new-tokens", "3", "--seed", "2", "--world-size", "2"]
    assert main(["generate", *common, "--strategy", "usp", "--no-memory"]) == 2
    assert "--ulysses-degree" in capsys.readouterr().err
    assert main(["generate", *common, "--strategy", "burst", "--ring-degree", "2", "--no-memory"]) == 2
    assert "options of --strategy usp" in capsys.readouterr().err
    assert main(["bench", "infer", "--quick", "--strategies", "usp", "--world-size", "2"]) == 2
    assert "--ulysses-degree" in capsys.readouterr().err
    usp = _run(capsys, *common, "--strategy", "usp", "--ulysses-degree", "2", "--no-memory")
    burst = _run(capsys, *common, "--strategy", "burst", "--no-memory")
    assert usp["tokens"] == burst["tokens"] and len(usp["tokens"]) == 3


def test_hf_dir_without_transformers_says_how_to_install(capsys, tmp_path, monkeypatch):
    """A Hugging Face directory without transformers: how to install it, no bare ModuleNotFoundError."""
    (tmp_path / "m").mkdir()
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # import transformers -> ImportError
    assert main(["generate", "--model", str(tmp_path / "m"), "--world-size", "1", "--prompt-len", "4"]) == 2
    assert "pip install 'burstattn[hf]'" in capsys.readouterr().err


def test_hf_dir_uses_the_current_cache_keyword(tmp_path):
    """No `past_key_values` deprecation warning (transformers >= 5.24 calls it `cache`)."""
    import warnings

    pytest.importorskip("transformers", minversion="5")
    from burstattn.cli.generate_run import GenerateConfig, generate_rank
    from tests.dist.cases.hf_models import build_causal_lm

    build_causal_lm("llama", seed=3).save_pretrained(tmp_path / "m")
    cfg = GenerateConfig(model=str(tmp_path / "m"), prompt_len=9, max_new_tokens=3, measure_memory=False,
                         warmup=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = generate_rank(0, 1, cfg)
    assert len(res["tokens"]) == 3
    assert not [w for w in seen if "past_key_values" in str(w.message)], [str(w.message) for w in seen]


HYBRIDS = ("qwen3_next", "bamba", "minimax")


def _hybrid_rank(rank: int, world: int, directory: str) -> list:
    from burstattn.cli.generate_run import GenerateConfig, generate_rank

    cfg = GenerateConfig(model=directory, world_size=world, prompt_len=9, max_new_tokens=4, measure_memory=False,
                         warmup=False)
    return generate_rank(rank, world, cfg)["tokens"]


@pytest.mark.parametrize("world", [2, 3])
def test_saved_hybrids_generate_exactly(pools, tmp_path, world):
    """`generate --model DIR` on a saved Qwen3-Next, Bamba and MiniMax patches their mixers itself: every rank's
    tokens equal transformers' own greedy generation on one process (MiniMax, which takes no cache but its
    own, by sharded forwards of the whole sequence)."""
    pytest.importorskip("transformers", minversion="5")
    import torch

    from tests.dist.cases.hf_hybrid import build_hybrid

    for kind in HYBRIDS:
        model = build_hybrid(kind, seed=4)
        model.save_pretrained(tmp_path / kind)
        prompt = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
        model.generation_config.eos_token_id = None  # the command's greedy steps never stop early
        ref = model.generate(prompt, max_new_tokens=4, do_sample=False)[0, 9:].tolist()
        assert len(ref) == 4
        assert pools.get(world).run(_hybrid_rank, str(tmp_path / kind)) == [ref] * world, kind
