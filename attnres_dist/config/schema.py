"""Typed run configuration: nested dataclasses, one section per component.

Each section's fields, types and defaults. ``loader.py`` builds a ``Config`` from YAML plus
overrides and ``rules.py`` checks what the types alone cannot.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from attnres_dist.config.block_plan import BlockPlan


@dataclass
class AttnResConfig:
    # baseline | full | block | delta_full | delta_block (Delta AttnRes: the mix is added to
    # the residual stream; config/block_plan.py)
    mode: str = "block"
    block_size: int = 2  # sublayers per block (block and delta_block); 1 = full
    impl: str = "auto"  # depth-attention implementation: auto or a registered one
    # each norm after a depth mix scales its eps by the square of what zero queries scale the
    # stream by (1 / n for a mix of n, Delta 1 + 1 / n: BlockPlan.zero_query_scale), so a
    # model converted from a plain residual one is exact at step 0 (import-hf)
    source_scaled_eps: bool = False


# what the router balances with (Megatron-Core's moe_router_load_balancing_type; its
# global_aux_loss reduces token counts across data-parallel ranks inside the forward, which
# no single-process run reproduces, so it is not offered)
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")


@dataclass
class MoEConfig:
    """A mixture-of-experts MLP (Megatron-Core's MoELayer) in place of the dense one."""

    num_experts: int = 0  # 0 = a dense model
    top_k: int = 2  # experts each token is routed to
    expert_ffn_hidden_size: int | None = None  # None = model.ffn_hidden_size's value
    shared_expert_ffn_hidden_size: int | None = None  # a shared expert of this width; None = none
    # which layers keep the dense MLP: the first `dense_layers`, or `pattern` (one entry per
    # layer, 1 = MoE, 0 = dense: Megatron's moe_layer_freq list), which then wins
    dense_layers: int = 0
    pattern: list[int] | None = None
    load_balancing: str = "aux_loss"  # one of LOAD_BALANCING
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float | None = None  # the router's z-loss (ST-MoE); None = off
    # tokens an expert takes, in units of its fair share; None = dropless
    capacity_factor: float | None = None
    router_dtype: str = "fp32"  # fp32 | fp64 | model: the dtype the router's logits use
    # how the chosen experts are weighted: false, the softmax over their logits (Mixtral's);
    # true, each one's softmax over all logits (Switch's; Qwen3-MoE without norm_topk_prob);
    # null: true at top_k 1 (a softmax over one logit is 1), else false
    router_pre_softmax: bool | None = None
    token_dispatcher: str = "alltoall"  # alltoall | allgather (Megatron's token dispatchers)

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    @property
    def pre_softmax(self) -> bool:
        return self.top_k == 1 if self.router_pre_softmax is None else self.router_pre_softmax

    def is_moe_layer(self, index: int) -> bool:
        """Layer ``index`` (0-based) has the MoE MLP."""
        if not self.enabled:
            return False
        if self.pattern is not None:
            return bool(self.pattern[index])
        return index >= self.dense_layers


@dataclass
class ModelConfig:
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # grouped-query attention; None = one per head
    head_dim: int | None = None  # channels per attention head; None = hidden_size / heads
    qk_norm: bool = False  # RMSNorm of each head's query and key before RoPE (Qwen3's)
    ffn_hidden_size: int | None = None  # None = 4 * hidden, rounded for SwiGLU (8/3 h, to 64)
    seq_length: int = 128
    vocab_size: int | None = None  # None = the tokenizer's
    make_vocab_size_divisible_by: int = 128
    tie_embeddings: bool = True
    rotary_base: int = 10000
    # Llama 3's RoPE scaling factor (Megatron-Core's: frequency bands 1 and 4 over 8192
    # original positions); None = plain RoPE
    rope_scaling_factor: float | None = None
    init_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    norm_eps: float = 1e-5
    attnres: AttnResConfig = field(default_factory=AttnResConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    def block_plan(self) -> BlockPlan:
        return BlockPlan(self.num_layers, self.attnres.mode, self.attnres.block_size)

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return 64 * ((8 * self.hidden_size // 3 + 63) // 64)

    @property
    def kv_channels(self) -> int:
        """Channels per attention head."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def expert_ffn_size(self) -> int:
        return self.moe.expert_ffn_hidden_size or self.ffn_size


@dataclass
class DataConfig:
    path: str | None = None  # dataset prefix from prepare-data; None = embedded stdlib corpus
    # a weighted blend, as Megatron's --data-path: [w1, prefix1, w2, prefix2] or [{path, weight}]
    paths: list[Any] | None = None
    # Megatron's train,valid,test split string ("969,30,1"): the prefixes are then plain
    # indexed datasets (PREFIX.bin/.idx) split by document; None = prepare-data's own splits
    split: str | None = None
    # Megatron's document options (EOD-separated documents inside a sample)
    reset_position_ids: bool = False  # positions restart at 0 after every EOD
    reset_attention_mask: bool = False  # tokens attend only within their own document
    eod_mask_loss: bool = False  # no loss on predictions made at an EOD token
    tokenizer: str = "bytes"  # bytes | hf
    tokenizer_path: str | None = None  # tokenizer.json, for tokenizer: hf
    cache_dir: str = ".cache/data"


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping


@dataclass
class TrainConfig:
    steps: int = 300
    micro_batch_size: int = 8
    global_batch_size: int = 16  # = micro_batch_size * accumulation * dp
    seed: int = 1234
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    progress: bool = True
    # peak TFLOP/s of one device, for model FLOPs utilisation; None = known GPUs only
    peak_tflops: float | None = None


@dataclass
class ParallelConfig:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    # expert parallelism: each MoE layer's experts split over ep data-parallel ranks
    # (Megatron-Core's expert-parallel groups; it divides dp, so it adds no ranks)
    ep: int = 1
    # Megatron's sequence parallelism (tp > 1): outside the tensor-parallel matmuls the
    # activations, and the depth state with them, are split along the sequence over the tensor
    # ranks, so each stores and sends 1 / tp of the block list
    sequence_parallel: bool = False
    partition: str | list[int] = "uniform"  # uniform | parameters | [layers per stage]
    recompute: str = "none"  # none | attnres | full
    recompute_interval: int = 1  # layers per checkpointed chunk with recompute: full
    zero_stage: int = 0  # 0 | 1: ZeRO-1 shards fp32 master weights and AdamW state over dp
    timeout_s: int = 600  # process-group and stage-to-stage wait limit
    # 1f1b (DeepSpeed's TrainSchedule) | dualpipev (DeepSpeed's DualPipeV: 2 chunks per rank in
    # a V) | interleaved (looped chunks, chunk c on rank c mod pp, Megatron's interleaved order)
    schedule: str = "1f1b"
    virtual_stages: int = 1  # model chunks per rank; >= 2 only with schedule: interleaved
    # virtual stages only: each transition carries just the blocks its receiver lacks (false:
    # every transition carries all completed blocks, the naive contract)
    cross_stage_cache: bool = True


# the values of runtime.compile that compile: per layer, or per run of a stage's layers
COMPILED = ("layer", "chunk")


@dataclass
class RuntimeConfig:
    """Fast paths (attnres_dist.runtime): auto takes each one this machine can run."""

    layer_spec: str = "auto"  # auto | local | te (Megatron-Core's Transformer Engine spec)
    # str | bool: YAML reads a bare on/off as true/false; __post_init__ turns them back
    fused_norm: str | bool = "auto"  # auto | on | off (GPU: apex FusedRMSNorm; CPU: C kernel)
    fused_optimizer: str | bool = "auto"  # auto | on | off (apex FusedAdam)
    # auto | fp32 | bf16 (DeepSpeed's bf16 engine: bf16 params and payloads, fp32 master
    # weights; auto takes it on a GPU with bf16, explicit bf16 runs on CPU too)
    dtype: str = "auto"
    # auto | sdpa | megatron: the local spec's core attention (torch SDPA or Megatron's own)
    core_attention: str = "auto"
    # auto | retain | system: whether freed host memory stays in the process for reuse
    # (attnres_dist.runtime.allocator; auto: retain on a CPU run where the C library is glibc)
    cpu_allocator: str = "auto"
    # none | cores: each local rank on its own share of the cores (parallel/core_binding.py)
    cpu_binding: str = "none"
    # auto | off | layer | chunk: run each transformer layer (layer) or each run of consecutive
    # layers a stage holds (chunk: a model chunk, or with full recompute a recompute group) as
    # one torch.compile graph (regional compile, runtime/select.py says when auto takes it);
    # both take the torch depth-attention ops and torch's RMSNorm, which the compiler sees,
    # in place of the C kernels
    compile: str | bool = "auto"
    # auto | off | on: replay each compiled region as CUDA graphs (compile mode
    # reduce-overhead, CUDA graph trees); on needs compiled layers (layer or chunk) and a GPU;
    # auto takes it only once the GPU check has run it (runtime/gpu_checked.py)
    cuda_graphs: str | bool = "auto"
    # inductor | aot_eager | eager: the torch.compile backend of a compiled layer (torchtitan's
    # compile.backend); aot_eager traces forward and backward without generating code
    compile_backend: str = "inductor"
    # auto | steady | full: the guards TorchDynamo evaluates on a compiled layer's call in a
    # training step; steady: once a step compiled nothing, only those that tell cache entries
    # apart (model/compiled_region.py, SteadyGuards); auto: steady when compiled
    guards: str = "auto"

    def __post_init__(self):
        for name in ("fused_norm", "fused_optimizer", "compile", "cuda_graphs"):
            value = getattr(self, name)
            if isinstance(value, bool):
                setattr(self, name, "on" if value else "off")


@dataclass
class OutputConfig:
    run_dir: str = "runs/default"
    tensorboard: bool = True
    wandb: str | None = None  # Weights & Biases project (needs wandb installed); None = off


@dataclass
class MetricsConfig:
    every_k: int = 0  # instrument one micro-batch every k steps (diagnostics.jsonl); 0 = off


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None = <output.run_dir>/checkpoints
    every: int = 100  # save every N optimizer steps (0 = only at the end); always at the end
    keep_last: int = 3  # checkpoints kept in dir; older ones are deleted after each save
    resume: str = "auto"  # auto | none | a checkpoint, a directory of them, or a run directory


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def grad_accum_steps(self) -> int:
        t = self.train
        return t.global_batch_size // (t.micro_batch_size * self.parallel.dp)

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p.pp * p.dp * p.tp

    @property
    def local_seq_length(self) -> int:
        """The sequence positions one rank's activations hold (sequence parallelism: 1 / tp)."""
        p = self.parallel
        return self.model.seq_length // (p.tp if p.sequence_parallel else 1)
