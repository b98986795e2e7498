"""The functions that run inside the ranks of tests/dist's pools, grouped by area.

A ``tests/dist/test_*.py`` file holds the assertions; the functions it hands to ``pools.get(world).run``
live here, at module level, because the spawned ranks import them by name (they pickle by reference).

- :mod:`.attention`: one ``burst_attn_func`` call (values, bytes, shards, refusals), the registered op,
  16-bit inputs, every layout, the DistFlashAttn and double-ring schedules
- :mod:`.strategies`: every ``attention(strategy=...)``, head-chunked attention, the simulator's peaks
- :mod:`.features`: cross-attention, documents, softcap, ALiBi, sinks, V's head size; flash-attn's conventions
- :mod:`.masks`: masks, masked calls, ``mask_partition``
- :mod:`.agreement`: what every rank must agree on, and the traps of a group
- :mod:`.hybrid`: sequence-parallel recurrences and the hybrid model
- :mod:`.models`: the library's own models: training, dispatch, the fused loss, generation
- :mod:`.hf_models`, :mod:`.hf_hybrid`, :mod:`.hf_trainer`: transformers models, hybrid families, Trainer
"""
