import pytest

from burstattn.models import PRESETS, LlamaConfig, preset


def test_presets_have_the_published_sizes():
    # published parameter counts (untied heads): 6.74B, 13.0B, 8.03B, 69.0B, 405.9B
    expected = {"llama-7b": 6.74e9, "llama-13b": 13.0e9, "llama3-8b": 8.03e9, "llama-70b": 69.0e9,
                "llama3-405b": 405.9e9}
    for name, count in expected.items():
        assert abs(preset(name).num_params() - count) / count < 0.01, name
    assert {"tiny", "small"} <= set(PRESETS)


def test_config_roundtrip_and_errors():
    cfg = preset("tiny")
    assert LlamaConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.head_dim == 16
    with pytest.raises(ValueError, match="unknown field"):
        LlamaConfig.from_dict({"dimm": 3})
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_layers"):
        LlamaConfig(n_layers=0)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("gpt5")
