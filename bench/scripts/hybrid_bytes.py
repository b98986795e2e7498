"""Bytes per rank of hybrid-small's layers at 32K tokens per rank, world 2: one Gated DeltaNet layer's
conv halo + state passing (measured with comm_stats, fwd + bwd, and by formula) against one attention
layer's burst ring traffic (by formula: ring_bytes; it is measured equal to it in tests/dist). The
recurrent bytes do not depend on the length, so they are measured at --measure-seq tokens per rank.

    python -m bench.scripts.hybrid_bytes [--local-seq 32768]
"""
from __future__ import annotations

import argparse
import json

import torch


def rank_main(rank: int, world: int, n: int) -> dict:
    import burstattn
    from burstattn.models import preset
    from burstattn.recurrent import sp_causal_conv1d, sp_gated_delta_rule

    c = preset("hybrid-small")
    hk, hv = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    torch.manual_seed(rank)
    x = torch.randn(1, n, 2 * hk + hv, requires_grad=True)
    w = torch.randn(2 * hk + hv, 4)
    g = -torch.rand(1, n, c.linear_num_value_heads)
    beta = torch.rand(1, n, c.linear_num_value_heads)
    with burstattn.comm_stats() as stats:
        y = sp_causal_conv1d(x, w, activation="silu", layout="zigzag")
        q, k, v = y.split([hk, hk, hv], -1)
        o, _ = sp_gated_delta_rule(q.reshape(1, n, c.linear_num_key_heads, -1), k.reshape(1, n, c.linear_num_key_heads, -1),
                                   v.reshape(1, n, c.linear_num_value_heads, -1), g, beta, layout="zigzag",
                                   use_qk_l2norm=True, chunk_size=c.linear_chunk)
        o.sum().backward()
    return stats.as_dict()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--local-seq", type=int, default=32768)
    ap.add_argument("--measure-seq", type=int, default=2048,
                    help="tokens per rank of the measured run (the recurrent bytes do not depend on it)")
    args = ap.parse_args()
    from burstattn.engine.bytes import ring_bytes
    from burstattn.models import preset
    from burstattn.recurrent import conv_halo_bytes, state_passing_bytes
    from burstattn.testing.launch import run_local

    c, n, P = preset("hybrid-small"), args.local_seq, 2
    hk, hv = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    measured = run_local(rank_main, P, args.measure_seq)[0]
    state = state_passing_bytes(n * P, P, "zigzag", batch=1, heads=c.linear_num_value_heads, dk=c.linear_key_head_dim,
                                dv=c.linear_value_head_dim, matrix=True)
    halo = conv_halo_bytes(n * P, P, "zigzag", batch=1, channels=2 * hk + hv)
    attn = ring_bytes(batch=1, local_seq=n, world_size=P, q_heads=c.n_heads, kv_heads=c.n_kv_heads,
                      head_dim=c.head_dim, dtype=torch.float32, backward="burst")
    print(json.dumps(dict(local_seq=n, world=P, measured_seq=args.measure_seq, measured_gdn=measured, formula_gdn=dict(state=state, halo=halo),
                          formula_attention=dict(forward=attn["forward"], backward=attn["backward"])), indent=1))


if __name__ == "__main__":
    main()
