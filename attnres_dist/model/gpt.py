"""The AttnRes GPT: builders for its parts, and the single-process model made of them.

Every part is built under its own seed derived from (run seed, part name, global layer index),
with Megatron's CPU initialisation (the full master weight is drawn, then this tensor-parallel
rank's shard is taken). So the weights of layer 7 are the same whether it lives in a
single-process model, on stage 3 of 4, or is split over two tensor-parallel ranks: every
parallel layout starts from the single-process reference's parameters.

The pipeline module (``attnres_dist.pipeline``) builds the same parts in the same order:
``[embedding, layer_0 .. layer_{n-1}, final aggregation, lm head]``.

The builder applies the run's ``RuntimeChoice`` (``attnres_dist.runtime``): the layer spec
(local or Transformer Engine) and the norm implementation are decided there and nowhere else
(bf16 is DeepSpeed's engine: it casts the built parts). Without a choice it builds the
reference path (local spec, torch ops, fp32).
"""

from __future__ import annotations

import contextlib
import zlib

import torch

from attnres_dist import megatron_compat
from attnres_dist.config import ModelConfig
from attnres_dist.config.block_plan import BlockPlan
from attnres_dist.model import dropout_streams, layer_specs
from attnres_dist.model.attnres_layer import AttnResLayer
from attnres_dist.model.document_masks import DocumentOptions, loss_mask
from attnres_dist.model.embedding_head import Embedding, FinalAggregation, OutputLayer, lm_loss
from attnres_dist.model.layer_runs import CompileOptions, apply_runs
from attnres_dist.model.megatron_config import padded_vocab_size, transformer_config
from attnres_dist.model.moe import init_experts, moe_layer_spec
from attnres_dist.runtime import RuntimeChoice
from attnres_dist.runtime.select import select_depth_attention


@contextlib.contextmanager
def seeded(seed: int, name: str):
    """Fork the RNG and seed it from (seed, name): initialisation independent of build order."""
    derived = (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
    devices = [torch.cuda.current_device()] if megatron_compat.cuda_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(derived)
        yield


class ModelBuilder:
    """Builds the model's parts for one config, tensor-parallel size and seed."""

    def __init__(
        self,
        model: ModelConfig,
        vocab_size: int,
        tp: int = 1,
        seed: int = 0,
        dtype=torch.float32,
        runtime: RuntimeChoice | None = None,
        documents: DocumentOptions | None = None,
        ep: int = 1,
        sequence_parallel: bool = False,
    ):
        megatron_compat.apply()
        self.documents = documents  # Megatron's document options; None = plain causal samples
        self.runtime = runtime or RuntimeChoice.reference()
        self.model = model
        self.plan: BlockPlan = model.block_plan()
        self.vocab_size = padded_vocab_size(vocab_size, model.make_vocab_size_divisible_by, tp)
        self.config = transformer_config(
            model,
            tp=tp,
            dtype=dtype,
            on_gpu=self.runtime.on_gpu,
            ep=ep,
            sequence_parallel=sequence_parallel,
        )
        self.seed = seed
        self.depth_attention = self._depth_attention()

    def _depth_attention(self) -> str:
        """The implementation the mixers run: the config's name, or what ``auto`` resolved to
        (the run's RuntimeChoice; for callers without one, resolved for this device)."""
        requested = self.model.attnres.impl
        chosen = self.runtime.depth_attention
        if requested == "auto" and chosen is not None:
            return chosen.value
        device, compiled = self.runtime.device.value, self.runtime.compiled
        return select_depth_attention(requested, device, compiled).value

    @property
    def num_parts(self) -> int:
        return self.model.num_layers + 3

    def embedding(self) -> Embedding:
        with seeded(self.seed, "embedding"):
            part = Embedding(
                self.config, self.vocab_size, self.model.seq_length, self.plan, self.documents
            )
        return part

    def layer(self, index: int) -> AttnResLayer:
        from megatron.core.transformer.spec_utils import build_module

        moe = self.model.moe
        if moe.is_moe_layer(index):
            spec = moe_layer_spec(moe.num_experts, self.model.qk_norm)
            spec = layer_specs.patched(spec, self.runtime)
        else:
            spec = layer_specs.layer_spec(self.runtime, self.model.qk_norm)
        with seeded(self.seed, f"layer.{index}"):
            megatron_layer = build_module(spec, config=self.config, layer_number=index + 1)
            if moe.is_moe_layer(index):  # each expert by its global index, in its own fork
                init_experts(megatron_layer.mlp, lambda name: seeded(self.seed, name), index)
            part = AttnResLayer(
                megatron_layer,
                self.plan,
                index,
                impl=self.depth_attention,
                rotary_base=self.model.rotary_base,
                rope_scaling_factor=self.model.rope_scaling_factor,
            )
        if self.model.attnres.source_scaled_eps and self.plan.mode != "baseline":
            scale_norm_eps(part.sublayer_norms(), self.plan, 2 * index + 1)
        return part

    def final(self) -> FinalAggregation:
        with seeded(self.seed, "final"):
            part = FinalAggregation(self.config, self.plan, impl=self.depth_attention)
        norm = layer_specs.final_norm(self.runtime, self.config)  # gain init 1: no RNG drawn
        if norm is not None:
            part.final_norm = norm
        if self.model.attnres.source_scaled_eps and self.plan.mode != "baseline":
            scale_norm_eps([part.final_norm], self.plan, None)
        options = self.compile_options
        if options is not None:  # after its norm is final: a graph reads its epsilon
            part.compile_region(options.backend, options.cuda_graphs)
        return part

    @property
    def compile_options(self) -> CompileOptions | None:
        """What ``runtime.compile`` asks of the parts (None: nothing compiled). The layers
        are compiled by their chunk's runs (``model/layer_runs.py``), once the container knows
        which layers a chunk holds."""
        if not self.runtime.compiled:
            return None
        backend = self.runtime.compile_backend
        return CompileOptions(
            backend.value if backend else "inductor", self.runtime.graphed, self.runtime.chunked
        )

    def output(self) -> OutputLayer:
        with seeded(self.seed, "output"):
            part = OutputLayer(self.config, self.vocab_size)
        return part


def compile_regions(model: AttnResGPT, backend: str = "inductor") -> None:
    """Every transformer layer and the final aggregation of ``model`` as one compiled region
    each, as ``runtime.compile: layer`` builds them (here with any backend)."""
    model.final.compile_region(backend)
    model.apply_runs(CompileOptions(backend))


def scale_norm_eps(norms: list, plan: BlockPlan, first_sublayer: int | None) -> None:
    """Scale each norm's epsilon by the square of what zero queries scale the residual stream
    by in front of it (``first_sublayer`` onwards, 1-based; None: the final norm):
    ``BlockPlan.zero_query_scale``.

    At zero queries a mix of ``n`` sources is ``h / n`` with ``h`` the plain residual stream
    (Delta: ``h + h / n``), and ``RMSNorm_{c^2 eps}(c h) = RMSNorm_eps(h)``: the model equals
    its plain-residual twin exactly, not only up to the epsilon (``import-hf``)."""
    for k, norm in enumerate(norms):
        sublayer = None if first_sublayer is None else first_sublayer + k
        scale = plan.zero_query_scale(sublayer)  # exact: a Fraction
        norm.eps = norm.eps * scale.numerator**2 / scale.denominator**2


class AttnResGPT(torch.nn.Module):
    """Single-process model: embedding -> AttnRes layers -> final aggregation -> LM head."""

    def __init__(self, builder: ModelBuilder, recompute: str = "none", recompute_interval: int = 1):
        super().__init__()
        self.plan = builder.plan
        self.tie_embeddings = builder.model.tie_embeddings
        self.documents = builder.documents
        self.embedding = builder.embedding()
        self.layers = torch.nn.ModuleList(builder.layer(i) for i in range(builder.model.num_layers))
        self.final = builder.final()
        if not self.tie_embeddings:
            self.output = builder.output()
        self.recompute, self.recompute_interval = recompute, recompute_interval
        self.apply_runs(builder.compile_options)
        # DeepSpeed moves the pipeline's parts to the GPU; the single-process model moves itself
        self.device = torch.device("cuda") if builder.runtime.on_gpu else torch.device("cpu")
        self.graphed = builder.runtime.graphed  # its engine marks each step for the graph trees
        self.steady_guards = builder.runtime.steady_guards  # its engine's steps' guard stance
        self.to(self.device)

    def apply_runs(self, compile: CompileOptions | None) -> None:
        """The runs the layers are applied by: recompute and compile (``model/layer_runs.py``)."""
        layers, plan = list(self.layers), self.plan
        self.runs = apply_runs(
            layers, plan, self.recompute, self.recompute_interval, compile, self.final
        )

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states ``[s, b, h]`` for input ids ``[b, s]``."""
        state = self.embedding(tokens)
        for run in self.runs:
            state = run(state)
        return self.final(state)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Vocabulary-sharded logits ``[s, b, v / tp]``."""
        if self.training:  # one training forward = one micro-batch (dropout streams' key)
            dropout_streams.next_micro_batch()
        hidden = self.hidden_states(tokens)
        if self.tie_embeddings:
            return self.embedding.logits(hidden)
        return self.output(hidden)

    def loss(self, window: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of a token window batch ``[b, s + 1]``."""
        window = window.to(self.device)
        tokens = window[:, :-1]
        return lm_loss(self(tokens), window[:, 1:], loss_mask(tokens, self.documents))
