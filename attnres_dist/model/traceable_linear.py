"""Megatron-Core's ``RowParallelLinear`` that hands its own tensor-parallel group to the matmul.

``RowParallelLinear.forward`` calls ``linear_with_grad_accumulation_and_async_allreduce`` with
``tp_group=None``, which then looks the group up again
(``get_tensor_model_parallel_group_if_none``): a ``torch.distributed.get_rank()`` call and a
deprecation warning on rank 0, which TorchDynamo cannot trace (a graph break in every attention
projection and every MLP output of a compiled layer). The module already holds that group
(``self.tp_group``, resolved the same way at construction), so this subclass passes it: the
same group, the same arithmetic and parameters (a checkpoint never notices), and nothing left
for the compiler to skip. The local layer spec (``model/layer_specs.py``) builds the attention
output projection and the MLP's second linear with it, keeping tensor parallelism as it was.
"""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import RowParallelLinear


class TraceableRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` whose matmul gets ``self.tp_group`` instead of None."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group") is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)
