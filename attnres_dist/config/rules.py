"""Cross-field rules of a run configuration.

``validate(cfg)`` checks what the types alone cannot: sizes that must divide, ranges, the block
plan, the parallel layout against the model, the partition, and each section's choices. Every
failure is one ``ConfigError`` line naming the field, the value and the fix.
"""

from __future__ import annotations

from attnres_dist.config.block_plan import MODES
from attnres_dist.config.moe_rules import validate_moe
from attnres_dist.config.schedule_rules import chunks_per_rank, validate_schedule
from attnres_dist.config.schema import COMPILED, Config, RuntimeConfig
from attnres_dist.data.blend import parse_blend, parse_split
from attnres_dist.errors import ConfigError
from attnres_dist.ops import available_depth_attention_impls


def _require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise ConfigError(where, message)


def validate(cfg: Config) -> None:
    """Cross-field rules. Each failure names the field, the value and the fix."""
    m, t, o, p = cfg.model, cfg.train, cfg.optim, cfg.parallel
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        value = getattr(m, name)
        _require(value >= 1, f"model.{name}", f"got {value}; must be >= 1")
    _require(
        m.head_dim is not None or m.hidden_size % m.num_attention_heads == 0,
        "model.hidden_size",
        f"got {m.hidden_size}; must be divisible by num_attention_heads={m.num_attention_heads}"
        " (or set model.head_dim)",
    )
    _require(
        m.head_dim is None or m.head_dim >= 1,
        "model.head_dim",
        f"got {m.head_dim}; must be >= 1, or null for hidden_size / num_attention_heads",
    )
    groups = m.num_query_groups or m.num_attention_heads
    _require(
        groups >= 1 and m.num_attention_heads % groups == 0,
        "model.num_query_groups",
        f"got {m.num_query_groups}; must divide num_attention_heads={m.num_attention_heads}",
    )
    _require(m.ffn_size >= 1, "model.ffn_hidden_size", f"got {m.ffn_hidden_size}; must be >= 1")
    _require(
        m.vocab_size is None or m.vocab_size >= 2,
        "model.vocab_size",
        f"got {m.vocab_size}; must be >= 2 or null (take the tokenizer's)",
    )
    _require(
        m.make_vocab_size_divisible_by >= 1,
        "model.make_vocab_size_divisible_by",
        f"got {m.make_vocab_size_divisible_by}; must be >= 1",
    )
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(m, name)
        _require(0.0 <= value < 1.0, f"model.{name}", f"got {value}; must be in [0, 1)")
    _require(m.init_std > 0, "model.init_std", f"got {m.init_std}; must be > 0")
    _require(m.norm_eps > 0, "model.norm_eps", f"got {m.norm_eps}; must be > 0")
    _require(
        m.rope_scaling_factor is None or m.rope_scaling_factor >= 1,
        "model.rope_scaling_factor",
        f"got {m.rope_scaling_factor}; must be >= 1 (Llama 3's factor), or null for none",
    )
    _require(
        m.attnres.mode in MODES,
        "model.attnres.mode",
        f"got {m.attnres.mode!r}; allowed: {', '.join(MODES)}",
    )
    impls = ("auto", *available_depth_attention_impls())
    _require(  # whether this machine can run it is decided at start-up (select_runtime)
        m.attnres.impl in impls,
        "model.attnres.impl",
        f"got {m.attnres.impl!r}; allowed: {', '.join(impls)}",
    )
    m.block_plan()  # raises on an invalid block size

    d = cfg.data
    _require(
        d.tokenizer in ("bytes", "hf"),
        "data.tokenizer",
        f"got {d.tokenizer!r}; allowed: bytes, hf (with data.tokenizer_path)",
    )
    _require(
        d.tokenizer != "hf" or bool(d.tokenizer_path),
        "data.tokenizer_path",
        "is required with data.tokenizer: hf (path to a tokenizer.json)",
    )
    _require(
        not (d.path and d.paths),
        "data.paths",
        "is set together with data.path; give one dataset in data.path or a blend in data.paths",
    )
    if d.paths is not None:
        parse_blend(d.paths)
    if d.split is not None:
        parse_split(d.split)
    _require(
        d.split is None or bool(d.path or d.paths),
        "data.split",
        "needs data.path or data.paths naming Megatron indexed datasets (PREFIX.bin/.idx)",
    )

    _require(t.steps >= 1, "train.steps", f"got {t.steps}; must be >= 1")
    _require(t.micro_batch_size >= 1, "train.micro_batch_size", f"got {t.micro_batch_size}")
    per_step = t.micro_batch_size * p.dp
    _require(
        t.global_batch_size >= 1 and t.global_batch_size % per_step == 0,
        "train.global_batch_size",
        f"got {t.global_batch_size}; must be a positive multiple of micro_batch_size * "
        f"parallel.dp = {t.micro_batch_size} * {p.dp} = {per_step}",
    )
    _require(t.eval_every >= 0, "train.eval_every", f"got {t.eval_every}; must be >= 0 (0 = off)")
    _require(t.eval_batches >= 1, "train.eval_batches", f"got {t.eval_batches}; must be >= 1")
    _require(t.log_every >= 1, "train.log_every", f"got {t.log_every}; must be >= 1")
    _require(
        t.peak_tflops is None or 0 < t.peak_tflops < float("inf"),
        "train.peak_tflops",
        f"got {t.peak_tflops}; must be > 0 (one device's peak TFLOP/s) or null",
    )
    _require(
        cfg.output.wandb is None or cfg.output.wandb.strip() != "",
        "output.wandb",
        "is empty; use null (off) or a Weights & Biases project name",
    )

    _require(o.lr > 0, "optim.lr", f"got {o.lr}; must be > 0")
    _require(0 <= o.min_lr <= o.lr, "optim.min_lr", f"got {o.min_lr}; must be in [0, optim.lr]")
    _require(
        0 <= o.warmup_steps <= t.steps,
        "optim.warmup_steps",
        f"got {o.warmup_steps}; must be in [0, train.steps={t.steps}]",
    )
    _require(o.weight_decay >= 0, "optim.weight_decay", f"got {o.weight_decay}; must be >= 0")
    for name in ("beta1", "beta2"):
        value = getattr(o, name)
        _require(0 <= value < 1, f"optim.{name}", f"got {value}; must be in [0, 1)")
    _require(o.grad_clip >= 0, "optim.grad_clip", f"got {o.grad_clip}; must be >= 0 (0 = off)")

    for name in ("pp", "dp", "tp"):
        value = getattr(p, name)
        _require(value >= 1, f"parallel.{name}", f"got {value}; must be >= 1")
    _require(
        p.pp <= m.num_layers,
        "parallel.pp",
        f"got {p.pp}; at most model.num_layers={m.num_layers} stages (one layer per stage)",
    )
    for name, value in (
        ("num_attention_heads", m.num_attention_heads),
        ("num_query_groups", groups),
        ("ffn_hidden_size", m.ffn_size),
    ):
        _require(
            value % p.tp == 0,
            "parallel.tp",
            f"got {p.tp}; must divide model.{name}={value}",
        )
    validate_moe(cfg)
    _validate_sequence_parallel(cfg)
    validate_schedule(cfg)
    per_rank = chunks_per_rank(cfg)
    unit = "stage" if per_rank == 1 else "chunk"
    _validate_partition(p.partition, p.pp * per_rank, m.num_layers, unit)
    _validate_runtime(cfg.runtime)
    _validate_compile(cfg)
    _require(
        p.recompute in ("none", "attnres", "full"),
        "parallel.recompute",
        f"got {p.recompute!r}; allowed: none, attnres, full",
    )
    _require(
        p.recompute_interval >= 1,
        "parallel.recompute_interval",
        f"got {p.recompute_interval}; must be >= 1",
    )
    _require(
        p.zero_stage in (0, 1),
        "parallel.zero_stage",
        f"got {p.zero_stage}; allowed: 0, 1 (ZeRO-2/3 do not run with DeepSpeed's pipeline engine)",
    )
    _require(p.timeout_s >= 1, "parallel.timeout_s", f"got {p.timeout_s}; must be >= 1")
    k = cfg.metrics.every_k
    _require(k >= 0, "metrics.every_k", f"got {k}; must be >= 0 (0 = off, k = every k-th step)")

    c = cfg.checkpoint
    _require(c.every >= 0, "checkpoint.every", f"got {c.every}; must be >= 0 (0 = only at the end)")
    _require(c.keep_last >= 1, "checkpoint.keep_last", f"got {c.keep_last}; must be >= 1")
    _require(
        c.resume.strip() != "",
        "checkpoint.resume",
        "is empty; use auto, none, or the path of a checkpoint",
    )
    _require(c.dir is None or c.dir.strip() != "", "checkpoint.dir", "is empty; use null or a path")


def _validate_sequence_parallel(cfg: Config) -> None:
    p, m = cfg.parallel, cfg.model
    if not p.sequence_parallel:
        return
    _require(
        p.tp > 1,
        "parallel.sequence_parallel",
        f"true splits the sequence over the tensor ranks, but parallel.tp={p.tp}; set "
        "parallel.tp > 1 or sequence_parallel=false",
    )
    _require(
        m.seq_length % p.tp == 0,
        "parallel.sequence_parallel",
        f"true splits model.seq_length={m.seq_length} over parallel.tp={p.tp} ranks, which "
        "must divide it; change seq_length or tp",
    )
    _require(
        max(m.hidden_dropout, m.attention_dropout) == 0,
        "parallel.sequence_parallel",
        f"true with dropout (model.hidden_dropout={m.hidden_dropout}, attention_dropout="
        f"{m.attention_dropout}): the dropout streams are per sequence, not per split; set "
        "both to 0 or sequence_parallel=false",
    )
    _require(
        cfg.runtime.compile not in COMPILED,
        "parallel.sequence_parallel",
        f"true with runtime.compile={cfg.runtime.compile!r}: the sequence gathers are not "
        "traced yet; set runtime.compile=off or sequence_parallel=false",
    )


def _validate_runtime(r: RuntimeConfig) -> None:
    # Only the words here; whether this machine can run a requested path is decided at
    # start-up by attnres_dist.runtime.select_runtime (also a ConfigError naming the field).
    for name, allowed in (
        ("layer_spec", ("auto", "local", "te")),
        ("fused_norm", ("auto", "on", "off")),
        ("fused_optimizer", ("auto", "on", "off")),
        ("dtype", ("auto", "fp32", "bf16")),
        ("core_attention", ("auto", "sdpa", "megatron")),
        ("cpu_allocator", ("auto", "retain", "system")),
        ("cpu_binding", ("none", "cores")),
        ("compile", ("auto", "off", *COMPILED)),
        ("cuda_graphs", ("auto", "off", "on")),
        ("compile_backend", ("inductor", "aot_eager", "eager")),
        ("guards", ("auto", "steady", "full")),
    ):
        value = getattr(r, name)
        _require(
            value in allowed,
            f"runtime.{name}",
            f"got {value!r}; allowed: {', '.join(allowed)}",
        )


def _validate_compile(cfg: Config) -> None:
    """What compiled layers do not run yet: refused, never silently run eagerly."""
    compiled = cfg.runtime.compile in COMPILED
    _require(
        cfg.runtime.cuda_graphs != "on" or compiled,
        "runtime.cuda_graphs",
        f"'on' replays the compiled layers (runtime.compile=layer or chunk), but runtime.compile="
        f"{cfg.runtime.compile}; set runtime.compile=layer or runtime.cuda_graphs=off",
    )
    _require(
        cfg.runtime.cuda_graphs != "on" or cfg.runtime.compile_backend == "inductor",
        "runtime.cuda_graphs",
        f"'on' is inductor's CUDA graph trees, but runtime.compile_backend="
        f"{cfg.runtime.compile_backend}; set runtime.compile_backend=inductor",
    )
    _require(
        cfg.runtime.guards != "steady" or compiled,
        "runtime.guards",
        f"'steady' applies to compiled layers, but runtime.compile={cfg.runtime.compile}; "
        "set runtime.compile=layer or runtime.guards=auto",
    )
    if not compiled:
        return
    name = cfg.runtime.compile
    _require(
        cfg.parallel.tp == 1 or cfg.model.attention_dropout == 0,
        "runtime.compile",
        f"{name!r} at parallel.tp={cfg.parallel.tp} draws attention dropout inside Megatron's "
        "RNG tracker fork, which does not trace; set model.attention_dropout=0 or "
        "runtime.compile=off",
    )
    dropout = max(cfg.model.hidden_dropout, cfg.model.attention_dropout)
    _require(
        name != "chunk" or dropout == 0,
        "runtime.compile",
        f"'chunk' runs several layers in one graph, but each layer seeds its own dropout "
        f"streams outside its graph (model.hidden_dropout={cfg.model.hidden_dropout}, "
        f"model.attention_dropout={cfg.model.attention_dropout}); set both to 0 or "
        "runtime.compile=layer",
    )


def _validate_partition(partition, pp: int, num_layers: int, unit: str = "stage") -> None:
    if isinstance(partition, str):
        _require(
            partition in ("uniform", "parameters"),
            "parallel.partition",
            f"got {partition!r}; allowed: uniform, parameters, or a list of layers per stage",
        )
        return
    _require(
        len(partition) == pp and all(n >= 1 for n in partition) and sum(partition) == num_layers,
        "parallel.partition",
        f"got {partition}; need {pp} positive layer counts (one per {unit}) summing to "
        f"model.num_layers={num_layers}",
    )
