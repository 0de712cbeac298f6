"""Typed run configuration: nested dataclasses, one section per component.

A run is described by a YAML file plus dotted command-line overrides
(``model.num_layers=12``). ``load_config`` merges them, checks every field's type and every
cross-field rule, and raises ``ConfigError`` with one line naming the field, the value and what
is allowed. Nothing is built before the whole config is valid.
"""

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from attnres_dist.errors import ConfigError
from attnres_dist.model.block_plan import MODES, BlockPlan


@dataclass
class AttnResConfig:
    mode: str = "block"  # baseline | full | block
    block_size: int = 2  # sublayers per block (block mode); 1 = full
    impl: str = "lean"  # depth-attention implementation: lean | reference


@dataclass
class ModelConfig:
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # grouped-query attention; None = one per head
    ffn_hidden_size: int | None = None  # None = 4 * hidden, rounded for SwiGLU (8/3 h, to 64)
    seq_length: int = 128
    vocab_size: int | None = None  # None = the tokenizer's
    make_vocab_size_divisible_by: int = 128
    tie_embeddings: bool = True
    rotary_base: int = 10000
    init_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    norm_eps: float = 1e-5
    attnres: AttnResConfig = field(default_factory=AttnResConfig)

    def block_plan(self) -> BlockPlan:
        return BlockPlan(self.num_layers, self.attnres.mode, self.attnres.block_size)

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return 64 * ((8 * self.hidden_size // 3 + 63) // 64)


@dataclass
class DataConfig:
    path: str | None = None  # dataset prefix from prepare-data; None = embedded stdlib corpus
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


@dataclass
class ParallelConfig:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    partition: str | list[int] = "uniform"  # uniform | parameters | [layers per stage]
    recompute: str = "none"  # none | attnres | full
    recompute_interval: int = 1  # layers per checkpointed chunk with recompute: full
    timeout_s: int = 600  # process-group and stage-to-stage wait limit


@dataclass
class RuntimeConfig:
    """Fast paths (attnres_dist.runtime): auto takes each one this machine can run."""

    layer_spec: str = "auto"  # auto | local | te (Megatron-Core's Transformer Engine spec)
    # str | bool: YAML reads a bare on/off as true/false; __post_init__ turns them back
    fused_norm: str | bool = "auto"  # auto | on | off (apex FusedRMSNorm)
    fused_optimizer: str | bool = "auto"  # auto | on | off (apex FusedAdam)
    dtype: str = "auto"  # auto | fp32 | bf16 (bf16 autocast, fp32 master weights; GPU only)

    def __post_init__(self):
        for name in ("fused_norm", "fused_optimizer"):
            value = getattr(self, name)
            if isinstance(value, bool):
                setattr(self, name, "on" if value else "off")


@dataclass
class OutputConfig:
    run_dir: str = "runs/default"
    tensorboard: bool = True


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


# ---------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """YAML file (optional) + ``a.b=value`` overrides -> a validated Config."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("--config", f"file {str(path)!r} not found")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            line = getattr(getattr(exc, "problem_mark", None), "line", -1) + 1
            raise ConfigError(str(path), f"invalid YAML near line {line}") from None
        if not isinstance(raw, dict):
            raise ConfigError(str(path), "top level must be a mapping of sections")
    for item in overrides:
        _apply_override(raw, item)
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def config_from_dict(raw: dict) -> Config:
    """A validated Config from a plain dict (e.g. one stored in a checkpoint)."""
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def _apply_override(raw: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(repr(item), "overrides look like section.field=value")
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[:-1]), "is a value, not a section")
        node = child
    node[parts[-1]] = value


def _build(cls, raw: Any, prefix: str):
    where = prefix.rstrip(".") or "config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(where, f"got {raw!r}; expected a section (mapping)")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {prefix}{close[0]!r}?" if close else f"known: {', '.join(names)}"
            raise ConfigError(f"{prefix}{key}", f"unknown field; {hint}")
    kwargs = {}
    for name in names:
        if name not in raw:
            continue
        kwargs[name] = _coerce(hints[name], raw[name], f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(tp, value, where: str):
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where + ".")
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, where)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(where, f"got {value!r}; expected {_type_name(tp)}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(where, f"got {value!r}; expected {_type_name(tp)}")
        return [_coerce(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(where, f"got {value!r}; expected {_type_name(tp)}")


def _type_name(tp) -> str:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(t) for t in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


# ---------------------------------------------------------------------------- rules


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
        m.hidden_size % m.num_attention_heads == 0,
        "model.hidden_size",
        f"got {m.hidden_size}; must be divisible by num_attention_heads={m.num_attention_heads}",
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
        m.attnres.mode in MODES,
        "model.attnres.mode",
        f"got {m.attnres.mode!r}; allowed: {', '.join(MODES)}",
    )
    _require(
        m.attnres.impl in ("lean", "reference"),
        "model.attnres.impl",
        f"got {m.attnres.impl!r}; allowed: lean, reference",
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
    _validate_partition(p.partition, p.pp, m.num_layers)
    _validate_runtime(cfg.runtime)
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


def _validate_runtime(r: RuntimeConfig) -> None:
    # Only the words here; whether this machine can run a requested path is decided at
    # start-up by attnres_dist.runtime.select_runtime (also a ConfigError naming the field).
    for name, allowed in (
        ("layer_spec", ("auto", "local", "te")),
        ("fused_norm", ("auto", "on", "off")),
        ("fused_optimizer", ("auto", "on", "off")),
        ("dtype", ("auto", "fp32", "bf16")),
    ):
        value = getattr(r, name)
        _require(
            value in allowed,
            f"runtime.{name}",
            f"got {value!r}; allowed: {', '.join(allowed)}",
        )


def _validate_partition(partition, pp: int, num_layers: int) -> None:
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
        f"got {partition}; need {pp} positive layer counts (one per stage) summing to "
        f"model.num_layers={num_layers}",
    )
