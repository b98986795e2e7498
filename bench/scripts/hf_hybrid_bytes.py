"""Bytes per rank of one mixer layer of each supported Hugging Face hybrid family (state passing + conv
halo, burstattn.hf.patch_mixers) against one of its attention layers (burst ring, K/V and backward), by
formula, at the sizes of transformers 5.24's default config of each family (its flagship checkpoint's),
bf16 weights (the summaries are passed in float32, the recurrence's compute dtype), batch 1.

    python -m bench.scripts.hf_hybrid_bytes [--local-seq 32768] [--world 2]

The recurrent formulas are tested equal to comm_stats() in tests/dist/test_recurrent.py, ring_bytes in
tests/dist (strategies); neither recurrent term depends on the length.
"""
from __future__ import annotations

import argparse

import torch


def family_dims(kind: str):
    """``(config, state dict(heads, dk, dv, matrix) or None, conv (channels, width) or None, attention dict)``."""
    import transformers as tf

    cfg = {"qwen3_next": tf.Qwen3NextConfig, "kimi_linear": tf.KimiLinearConfig, "bamba": tf.BambaConfig,
           "nemotron_h": tf.NemotronHConfig, "minimax": tf.MiniMaxConfig, "lfm2": tf.Lfm2Config}[kind]()
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    attn = dict(q_heads=heads, kv_heads=kv, head_dim=hd)
    if kind == "qwen3_next":
        hk, hv = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
        return cfg, dict(heads=cfg.linear_num_value_heads, dk=cfg.linear_key_head_dim, dv=cfg.linear_value_head_dim,
                         matrix=True), (2 * hk + hv, cfg.linear_conv_kernel_dim), attn
    if kind == "kimi_linear":
        attn = dict(q_heads=heads, kv_heads=heads, head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                    v_head_dim=cfg.v_head_dim)  # MLA: K/V per head after the up-projection
        h, d = cfg.linear_num_heads, cfg.linear_head_dim
        return cfg, dict(heads=h, dk=d, dv=d, matrix=True), (3 * h * d, cfg.linear_conv_kernel_dim), attn
    if kind in ("bamba", "nemotron_h"):
        if kind == "bamba":
            h, p, n, g, expand, width = (cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_n_groups,
                                         cfg.mamba_expand, cfg.mamba_d_conv)
            inner = expand * cfg.hidden_size
        else:
            h, p, n, g, width = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups, cfg.conv_kernel
            inner = h * p
        return cfg, dict(heads=h, dk=n, dv=p, matrix=False), (inner + 2 * g * n, width), attn
    if kind == "minimax":
        return cfg, dict(heads=heads, dk=hd, dv=hd, matrix=False), None, attn
    return cfg, None, (cfg.hidden_size, cfg.conv_L_cache), attn  # lfm2


def rows(local_seq: int, world: int) -> list:
    from burstattn.engine.bytes import ring_bytes
    from burstattn.recurrent import conv_halo_bytes, state_passing_bytes

    N, out = local_seq * world, []
    for kind in ("qwen3_next", "kimi_linear", "bamba", "nemotron_h", "minimax", "lfm2"):
        _, state, conv, attn = family_dims(kind)
        s = 0 if state is None else sum(state_passing_bytes(N, world, "zigzag", batch=1, **state).values())
        c = 0 if conv is None else sum(conv_halo_bytes(N, world, "zigzag", batch=1, channels=conv[0], width=conv[1],
                                                       element_size=2).values())
        a = ring_bytes(batch=1, local_seq=local_seq, world_size=world, dtype=torch.bfloat16, backward="burst", **attn)
        out.append(dict(family=kind, state=s, halo=c, attention=a["forward"] + a["backward"], state_shape=state,
                        ratio=(a["forward"] + a["backward"]) / max(s + c, 1)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--local-seq", type=int, default=32768)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    print("| family | state per head [dk x dv] (transition) | state passing | conv halo | attention layer | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows(args.local_seq, args.world):
        st = r["state_shape"]
        shape = "-" if st is None else (f"{st['heads']} x [{st['dk']} x {st['dv']}] "
                                        f"({'dk x dk' if st['matrix'] else 'scalar'})")
        print(f"| {r['family']} | {shape} | {r['state']:,} | {r['halo']:,} | {r['attention']:,} | {r['ratio']:,.0f}x |")


if __name__ == "__main__":
    main()
