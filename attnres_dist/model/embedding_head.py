"""The ends of the model: token embedding in, final aggregation + norm + LM head + loss out.

* ``Embedding`` turns token ids ``[b, s]`` into the first DepthState (``b_0 = v_0``, Megatron's
  ``[s, b, h]`` layout) and, for tied embeddings, also computes the LM logits with its weight.
* ``FinalAggregation`` attends once more over all blocks (own zero-init query and key norm),
  then applies the final norm; baseline and Delta AttnRes normalise the residual stream.
* ``OutputLayer`` is the untied LM head. Logits stay vocabulary-sharded under tensor parallelism
  and the loss is Megatron's vocab-parallel cross entropy (torch's on a single tensor rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnres_dist.config.block_plan import BlockPlan
from attnres_dist.model import compiled_region, dropout_streams
from attnres_dist.model.depth_mixing import DepthMixer, mixer_weights
from attnres_dist.model.depth_state import DepthState
from attnres_dist.model.document_masks import DocumentOptions, document_layout
from attnres_dist.model.layer_specs import TorchRMSNorm


def _final_norm(config):
    return TorchRMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)


def _lm_head(config, vocab_size: int, skip_weight: bool):
    from megatron.core import tensor_parallel

    return tensor_parallel.ColumnParallelLinear(
        config.hidden_size,
        vocab_size,
        config=config,
        init_method=config.init_method,
        bias=False,
        gather_output=False,
        skip_weight_param_allocation=skip_weight,
    )


class Embedding(torch.nn.Module):
    def __init__(
        self,
        config,
        vocab_size: int,
        max_seq_length: int,
        plan: BlockPlan,
        documents: DocumentOptions | None = None,
    ):
        super().__init__()
        self.documents = documents
        from megatron.core.models.common.embeddings.language_model_embedding import (
            LanguageModelEmbedding,
        )

        self.plan = plan
        self.dropout = config.hidden_dropout  # Megatron's embedding dropout
        self.embedding = LanguageModelEmbedding(
            config=config,
            vocab_size=vocab_size,
            max_sequence_length=max_seq_length,
            position_embedding_type="rope",
        )
        self.lm_head = _lm_head(config, vocab_size, skip_weight=True)

    @property
    def word_embeddings(self):
        return self.embedding.word_embeddings

    def forward(self, tokens: torch.Tensor) -> DepthState:
        keyed = self.training and self.dropout > 0
        with dropout_streams.layer_streams(dropout_streams.EMBEDDING, keyed):
            v0 = self.embedding(input_ids=tokens, position_ids=None)  # [s, b, h]
        layout = None
        if self.documents is not None and self.documents.per_sample:
            layout = document_layout(tokens, self.documents)
        if self.plan.mode == "baseline":
            return DepthState(None, v0, 0, layout)
        return DepthState.start(v0, layout)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied LM head: vocabulary-sharded logits ``[s, b, v / tp]``."""
        out, _ = self.lm_head(hidden, weight=self.word_embeddings.weight)
        return out


class FinalAggregation(torch.nn.Module):
    probe = None  # measurement hook, as AttnResLayer.probe
    segment = None  # the last layer's two-phase segment, when its phase 1 has this query

    def __init__(self, config, plan: BlockPlan, impl: str = "lean"):
        super().__init__()
        self.plan = plan
        if plan.has_final_mix:
            self.mixer_weights = mixer_weights(1, config.hidden_size)
            self.mixer = DepthMixer(self.mixer_weights, 0, impl)
        self.final_norm = _final_norm(config)
        self._region = self.aggregate  # the compiled region (``compile_region``) or itself

    def compile_region(self, backend: str = "inductor", cuda_graphs: bool = False) -> None:
        """Run :meth:`aggregate` as one compiled region (``model/compiled_region.py``)."""
        self._region = compiled_region.compile_region(self.aggregate, backend, cuda_graphs)

    def forward(self, state: DepthState) -> torch.Tensor:
        if state.layers_done != self.plan.num_layers:
            raise RuntimeError(
                f"final aggregation got a state after {state.layers_done} of "
                f"{self.plan.num_layers} layers"
            )
        if self.probe is None:
            return self._region(state)
        hidden = self._mix(state, self._phase2_inputs(state))  # measured: eager, unnormed
        self.probe.final(self, state, hidden)
        return self.final_norm(hidden)

    def aggregate(self, state: DepthState) -> torch.Tensor:
        """The final mix and norm (one fused merge and norm where the implementation has
        one): the region ``compile_region`` compiles."""
        merge = self._phase2_inputs(state)
        if merge is not None:
            return self.mixer.merge(*merge, norm=self.final_norm)
        return self.final_norm(self._mix(state, merge))

    def _mix(self, state: DepthState, merge) -> torch.Tensor:
        """The final mix before its norm; ``merge``: ``_phase2_inputs(state)``."""
        if merge is not None:
            return self.mixer.merge(*merge)
        if self.plan.mode == "baseline":
            return state.partial
        if self.plan.delta:  # no final mix: the norm reads the residual stream
            return state.stream()
        return self.mixer.attend_store(state)

    def _phase2_inputs(self, state: DepthState):
        """``merge``'s arguments from the last segment's phase 1, or None where it did not run
        this query (``configure_segments``)."""
        segment, cache = self.segment, state.phase1
        if segment is None or cache is None or cache.first != segment.first:
            return None
        if len(cache.out1) != len(segment.mixers):  # the layers' segments were made anew
            return None
        sublayer = segment.first + segment.mixers.index(self.mixer)
        out1, lse, extra, into = state.merge_inputs(sublayer, self.mixer.grad_into)
        return out1, lse, extra, state.store.dtype, into


class OutputLayer(torch.nn.Module):
    def __init__(self, config, vocab_size: int):
        super().__init__()
        self.lm_head = _lm_head(config, vocab_size, skip_weight=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out, _ = self.lm_head(hidden)
        return out


def lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean next-token cross entropy; ``logits`` ``[s, b, v/tp]``, ``labels`` ``[b, s]``.

    With a ``loss_mask`` ``[b, s]`` it is Megatron's masked mean over the micro-batch,
    ``sum(loss * mask) / sum(mask)`` (a micro-batch with nothing to predict gives 0).
    With the vocabulary on one rank the per-token losses are torch's fused cross entropy;
    split over tensor ranks, Megatron's vocab-parallel one (the same math, plus three
    all-reduces over the tensor group, which on one rank are pure overhead).
    """
    from megatron.core import parallel_state, tensor_parallel

    labels = labels.transpose(0, 1)  # [s, b], as the logits
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        flat = logits.float().flatten(0, 1)
        if loss_mask is None:
            return F.cross_entropy(flat, labels.reshape(-1))
        losses = F.cross_entropy(flat, labels.reshape(-1), reduction="none").view(labels.shape)
    else:
        losses = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels.contiguous())
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.transpose(0, 1).to(losses.dtype)
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)
