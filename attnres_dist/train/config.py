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
from attnres_dist.model.block_plan import BlockPlan
from attnres_dist.train.config_rules import validate


@dataclass
class AttnResConfig:
    mode: str = "block"  # baseline | full | block
    block_size: int = 2  # sublayers per block (block mode); 1 = full
    impl: str = "auto"  # depth-attention implementation: auto or a registered one


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
    partition: str | list[int] = "uniform"  # uniform | parameters | [layers per stage]
    recompute: str = "none"  # none | attnres | full
    recompute_interval: int = 1  # layers per checkpointed chunk with recompute: full
    zero_stage: int = 0  # 0 | 1: ZeRO-1 shards fp32 master weights and AdamW state over dp
    timeout_s: int = 600  # process-group and stage-to-stage wait limit


@dataclass
class RuntimeConfig:
    """Fast paths (attnres_dist.runtime): auto takes each one this machine can run."""

    layer_spec: str = "auto"  # auto | local | te (Megatron-Core's Transformer Engine spec)
    # str | bool: YAML reads a bare on/off as true/false; __post_init__ turns them back
    fused_norm: str | bool = "auto"  # auto | on | off (apex FusedRMSNorm)
    fused_optimizer: str | bool = "auto"  # auto | on | off (apex FusedAdam)
    # auto | fp32 | bf16 (DeepSpeed's bf16 engine: bf16 params and payloads, fp32 master
    # weights; auto takes it on a GPU with bf16, explicit bf16 runs on CPU too)
    dtype: str = "auto"
    # auto | sdpa | megatron: the local spec's core attention (torch SDPA or Megatron's own)
    core_attention: str = "auto"

    def __post_init__(self):
        for name in ("fused_norm", "fused_optimizer"):
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
    if tp is Any:  # checked by the field's own rule (config_rules)
        return value
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
