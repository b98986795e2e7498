"""KV heads under tensor parallelism when ``tp`` exceeds the model's kv heads: replicate them, as
Megatron-LM does for grouped-query attention (each kv head on ``tp / n_kv_heads`` ranks).

Tensor-parallel rank ``t`` holds query heads ``[t Hq/tp, (t+1) Hq/tp)``; with ``tp % Hkv == 0`` and
``tp > Hkv`` they all read one kv head, ``t * Hkv // tp`` (``h // (Hq/Hkv)`` for each of its heads ``h``).
:class:`ReplicatedKV` keeps ``wk`` / ``wv`` whole on every tp rank (``Replicate``), projects, and hands
the attention only that head's columns. The gradient of the projection's output is then a partial
sum over the tp ranks (each rank contributes only through its own head), so the local output is
declared ``Partial`` for the backward: DTensor sums the weight's and the input's gradients over tp
(one all-reduce each, as for the column-parallel ``wq``'s input).

Cost against a model whose kv heads split: ``wk`` and ``wv`` are not divided by ``tp`` (each rank
holds ``2 * dim * Hkv * head_dim`` weights, their gradients and optimizer state), and their weight
gradients are all-reduced over tp (``2 * dim * Hkv * head_dim`` elements per layer and step).
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel


def replicated_kv_problem(n_kv_heads: int, tp: int):
    """Why kv heads cannot be replicated over ``tp`` ranks (``None`` if they can, or need not be)."""
    if n_kv_heads % tp == 0:
        return None
    if tp % n_kv_heads:
        return (f"tensor parallelism over {tp} ranks needs n_kv_heads ({n_kv_heads}) divisible by {tp}, or {tp} "
                f"divisible by n_kv_heads (each kv head then replicated on {tp} / {n_kv_heads} ranks)")
    return None


def kv_head_of(tp_rank: int, tp: int, n_kv_heads: int) -> int:
    """The one kv head tensor-parallel rank ``tp_rank`` reads when ``tp > n_kv_heads``."""
    return tp_rank * n_kv_heads // tp


class ReplicatedKV(ColwiseParallel):
    """``wk`` / ``wv`` whole on every tp rank; the output is this rank's kv head, ``[..., head_dim]``."""

    def __init__(self, head_dim: int, n_kv_heads: int) -> None:
        super().__init__()
        self.head_dim, self.n_kv_heads = head_dim, n_kv_heads

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in module.named_parameters():
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, device_mesh, [Replicate()]),
                                                          requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh):
        head_dim, n_kv = self.head_dim, self.n_kv_heads

        def output_fn(mod, outputs: DTensor, mesh):
            # [B, n, Hkv * hd] replicated -> this rank's head [B, n, hd]; its gradient is a partial sum over tp
            local = outputs.to_local(grad_placements=(Partial(),))
            head = kv_head_of(mesh.get_local_rank(), mesh.size(), n_kv)
            return local[..., head * head_dim:(head + 1) * head_dim]

        from torch.distributed.tensor import distribute_module
        from functools import partial
        return distribute_module(module, device_mesh, self._partition_linear_fn,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 output_fn)
