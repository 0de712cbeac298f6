"""The Trainer: build everything a run needs from its Config, then train.

``Trainer(cfg).train()`` opens the data (building the embedded default corpus on first use;
samples come from megatron-core's GPTDataset, ``data/gpt_samples.py``), starts the process
groups, builds the model parts and the engine, and runs the loop: deterministic global batches
(each built one step ahead in a background thread, ``data/prefetch.py``), one optimizer step
each, periodic validation, and per logged step the loss, learning rate, gradient norm (before
clipping), tokens/s, MFU and every rank's peak memory. A world of one process runs the
plain-PyTorch reference engine; anything larger runs the DeepSpeed pipeline engine over the
same parts. Both see exactly the same data at every step.

Checkpoints (``attnres_dist.checkpoint``): the one to resume is chosen before any process group
starts, loaded right after the engine is built, and the loop continues from its step; saves
happen every ``checkpoint.every`` steps and at the end, never after a non-finite loss.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from attnres_dist import data as data_lib
from attnres_dist.checkpoint import faults
from attnres_dist.checkpoint.manager import Checkpointing
from attnres_dist.config import Config
from attnres_dist.config.moe_rules import validate_moe_runtime
from attnres_dist.data.gpt_samples import open_samples, plan_data
from attnres_dist.data.prefetch import Prefetcher
from attnres_dist.diagnostics.collector import Diagnostics, root_module
from attnres_dist.errors import ConfigError
from attnres_dist.model import dropout_streams
from attnres_dist.model.document_masks import DocumentOptions
from attnres_dist.model.gpt import AttnResGPT, ModelBuilder
from attnres_dist.model.moe import RoutingStats
from attnres_dist.parallel.core_binding import bind_cores
from attnres_dist.parallel.dims import ParallelDims
from attnres_dist.parallel.launch_env import detect_launch_env
from attnres_dist.parallel.process_groups import init_distributed
from attnres_dist.pipeline import precision
from attnres_dist.runtime import select_runtime
from attnres_dist.train.guards import check_finite_loss
from attnres_dist.train.metrics import MetricsWriter, check_wandb
from attnres_dist.train.signals import StepSignals


def check_vocab(plan, vocab_size: int) -> None:
    """Refuse a model whose embedding table cannot hold every token id in the data."""
    meta = plan.meta
    if plan.split is None:
        for prefix in plan.blend.prefixes:
            data_lib.indexed.check_vocab(prefix, data_lib.indexed.read_metadata(prefix), vocab_size)
    elif int(meta["max_token_id"]) >= vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"got {vocab_size}; the data has token id {meta['max_token_id']}: set it to at "
            f"least {int(meta['max_token_id']) + 1}",
        )


def resolve_dataset(cfg: Config):
    """(train samples, valid samples, test samples or None, metadata) of the configured data,
    or of the default corpus."""
    d, t = cfg.data, cfg.train
    default = None
    if not (d.path or d.paths):
        tokenizer = None  # bytes, unless the run names a Hugging Face tokenizer
        if d.tokenizer == "hf":
            tokenizer = data_lib.build_tokenizer("hf", d.tokenizer_path)
        default = data_lib.ensure_default_corpus(d.cache_dir, tokenizer)
    plan = plan_data(d, default)
    check_vocab(plan, cfg.model.vocab_size or int(plan.meta["vocab_size"]))
    train, valid, test = open_samples(
        plan,
        cfg.model.seq_length,
        t.seed,
        train_samples=t.steps * t.global_batch_size,
        eval_samples=t.eval_batches * t.micro_batch_size,
        cache_dir=d.cache_dir,
    )
    return train, valid, test, plan.meta


def document_options(cfg: Config, meta: dict) -> DocumentOptions | None:
    d = cfg.data
    if not (d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss):
        return None
    return DocumentOptions(
        int(meta["eod"]), d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss
    )


def model_vocab_size(cfg: Config, meta: dict) -> int:
    vocab = cfg.model.vocab_size or int(meta["vocab_size"])
    if vocab < int(meta["vocab_size"]):
        raise ConfigError(
            "model.vocab_size",
            f"got {vocab}; the dataset's tokenizer has {meta['vocab_size']} tokens",
        )
    return vocab


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        p = cfg.parallel
        self.dims = ParallelDims(p.pp, p.dp, p.tp, p.ep)
        # all input checks (data, vocabulary, world size) run before any process group starts
        check_wandb(cfg.output.wandb)
        self.train_data, self.valid_data, self.test_data, self.meta = resolve_dataset(cfg)
        vocab = model_vocab_size(cfg, self.meta)
        # fast paths; refusals are ConfigErrors
        self.runtime = select_runtime(
            cfg.runtime, cfg.model.attnres.impl, moe=cfg.model.moe.enabled
        )
        precision.check_supported(cfg, self.runtime, self.dims.world_size)
        validate_moe_runtime(cfg, self.runtime)
        # so does choosing the checkpoint to resume: missing, damaged or foreign ones are bad input
        self.checkpoints = Checkpointing.for_run(cfg, self.meta, vocab, self.dims.tp)
        launch = detect_launch_env()
        # before the process group starts, so that every thread it creates inherits the cores
        self.cpu_binding = bind_cores(launch, cfg.runtime.cpu_binding)
        self.launch = init_distributed(
            self.dims,
            cfg.parallel.timeout_s,
            cfg.train.seed,
            launch=launch,
            device=self.runtime.device.value,
        )
        torch.manual_seed(cfg.train.seed)
        self.builder = ModelBuilder(
            cfg.model,
            vocab,
            tp=self.dims.tp,
            seed=cfg.train.seed,
            runtime=self.runtime,
            documents=document_options(cfg, self.meta),
            ep=self.dims.ep,
            sequence_parallel=cfg.parallel.sequence_parallel,
        )
        self.engine = self._build_engine()
        self.start_step, self.resume_note = self.checkpoints.restore(
            self.engine, self.dims, self.launch.rank
        )
        self.is_logger = self.launch.rank == 0
        self.run_dir = Path(cfg.output.run_dir)
        self.metrics = MetricsWriter(
            self.run_dir,
            cfg.train.steps,
            tensorboard=cfg.output.tensorboard,
            progress=cfg.train.progress,
            enabled=self.is_logger,
            wandb_project=cfg.output.wandb,
            config=cfg.to_dict(),
        )
        self.signals = StepSignals(
            cfg.model,
            self.builder.vocab_size,
            self.dims.world_size,
            self.engine.device,
            cfg.train.peak_tflops,
        )
        self.diagnostics = Diagnostics.for_run(cfg, self.engine, self.dims, self.launch.rank)
        self.routing = None  # MoE: the routers' statistics, logged with each train record
        if cfg.model.moe.enabled:
            self.routing = RoutingStats(root_module(self.engine), cfg.model)

    def _build_engine(self):
        cfg = self.cfg
        # one process is the plain-PyTorch fp32 reference; DeepSpeed runs everything else,
        # including its bf16 engine on one process
        if self.dims.world_size == 1 and not self.runtime.bf16:
            from attnres_dist.train.local_engine import LocalEngine

            model = AttnResGPT(
                self.builder, cfg.parallel.recompute, cfg.parallel.recompute_interval
            )
            return LocalEngine(model, cfg.optim, cfg.train.steps)
        from attnres_dist.pipeline.engine import PipelineEngine

        return PipelineEngine(cfg, self.builder, self.dims, self.launch)

    # -- data ------------------------------------------------------------------------------

    def micro_batches(self, step: int) -> list[torch.Tensor]:
        """This data-parallel rank's micro-batches of global batch ``step``."""
        t = self.cfg.train
        batch = self.train_data.global_batch(step, t.global_batch_size)
        dp_rank = self.dims.coords(self.launch.rank)[1]
        return data_lib.split_micro_batches(batch, t.micro_batch_size, dp_rank, self.dims.dp)

    def eval_batches(self, samples=None) -> list[torch.Tensor]:
        t = self.cfg.train
        samples = self.valid_data if samples is None else samples
        return samples.eval_batches(t.eval_batches, t.micro_batch_size)

    # -- loop ------------------------------------------------------------------------------

    def evaluate(self, step: int, split: str = "valid") -> float:
        samples = self.test_data if split == "test" else self.valid_data
        loss = self.engine.eval_loss(self.eval_batches(samples))
        ppl = math.exp(min(loss, 50.0))
        self.metrics.log(step, split, loss=loss, ppl=ppl)
        name = "validation" if split == "valid" else split
        self.metrics.message(f"step {step}: {name} loss {loss:.4f} (ppl {ppl:.3f})")
        return loss

    def train(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        self.save_config()
        self.metrics.message(self.runtime.describe())
        self.metrics.message("cpu_binding={} ({})".format(*self.cpu_binding))
        if getattr(self.engine, "schedule_note", None):  # virtual stages: layout and boundary
            self.metrics.message(self.engine.schedule_note)
        self.metrics.message(
            f"{self.builder.plan.describe()}; {self.dims.describe()}; "
            f"{self.num_parameters():,} parameters; {len(self.train_data):,} train samples; "
            f"{self.signals.flops.total / 1e6:.2f} MFLOPs per token"
        )
        tokens_per_step = t.global_batch_size * cfg.model.seq_length
        start = time.perf_counter()
        window_start, window_tokens = start, 0
        for warning in self.checkpoints.warnings:
            self.metrics.message(f"warning: {warning}")
        if self.checkpoints.resume_from is not None:
            self.metrics.message(
                f"resumed from {self.checkpoints.resume_from.path} at step {self.start_step} "
                f"({self.resume_note})"
            )
        rank = self.launch.rank
        losses = []
        # (step, loss tensor) not read yet: reading a loss waits for the device, so the losses
        # are read together on the steps that log or save (finiteness is checked there, before
        # anything is saved)
        unread: list[tuple[int, torch.Tensor]] = []
        valid_loss = None
        # the next step's batches are built in a background thread while a step runs
        batches = Prefetcher(
            self.micro_batches, self.start_step, t.steps, pin=self.engine.device.type == "cuda"
        )
        try:
            for step in range(self.start_step, t.steps):
                faults.maybe_fail("before-step", rank, step + 1)
                # dropout masks: a function of (seed, step, global micro-batch, layer), any layout
                dp_rank = self.dims.coords(rank)[1]
                dropout_streams.begin_step(t.seed, step, dp_rank * cfg.grad_accum_steps)
                with self.diagnostics.step(step + 1):  # measures one micro-batch every k steps
                    unread.append((step + 1, self.engine.train_step(batches.get(step))))
                window_tokens += tokens_per_step
                logged = (step + 1) % t.log_every == 0 or step + 1 == t.steps
                if logged or self.checkpoints.due(step + 1, t.steps):
                    losses += self._read_losses(unread)
                    loss = losses[-1]
                if logged:
                    now = time.perf_counter()
                    signals = self.signals.record(window_tokens, now - window_start)  # collective
                    if self.routing is not None:
                        signals |= self.routing.read()  # collective
                    window_start, window_tokens = now, 0
                    norm = self.engine.last_grad_norm
                    self.metrics.log(
                        step + 1, "train", loss=loss, lr=self.engine.lr, grad_norm=norm, **signals
                    )
                    shown = {"loss": loss, "gnorm": norm, "tok_s": signals["tokens_per_s"]}
                    self.metrics.progress(
                        step + 1, **{k: v for k, v in shown.items() if v is not None}
                    )
                if self.checkpoints.due(step + 1, t.steps):
                    path = self.checkpoints.save(step + 1, self.engine, self.dims, rank)
                    self.metrics.log(step + 1, "checkpoint", path=str(path))
                faults.maybe_fail("after-step", rank, step + 1)
                if t.eval_every and (step + 1) % t.eval_every == 0 and step + 1 != t.steps:
                    self.evaluate(step + 1)
        finally:
            batches.close()
        dropout_streams.end()  # later forwards outside the loop draw sequentially again
        valid_loss = self.evaluate(t.steps)
        test_loss = self.evaluate(t.steps, "test") if self.test_data is not None else None
        wall = time.perf_counter() - start
        summary = {
            "steps": t.steps,
            "start_step": self.start_step,
            "final_train_loss": losses[-1] if losses else None,
            "final_valid_loss": valid_loss,
            "final_valid_ppl": math.exp(min(valid_loss, 50.0)),
            "final_test_loss": test_loss,
            "wall_time_s": round(wall, 2),
            "tokens_per_s": round(tokens_per_step * (t.steps - self.start_step) / wall, 1),
            "train_losses": losses,
        }
        if self.is_logger:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.diagnostics.close()
        self.metrics.close()
        return summary

    def _read_losses(self, unread: list[tuple[int, torch.Tensor]]) -> list[float]:
        """The unread steps' losses as numbers (one wait for the device), each checked to be
        finite; ``unread`` is emptied."""
        values = torch.stack([loss.reshape(()).double() for _, loss in unread]).tolist()
        for (step, _), value in zip(unread, values, strict=True):
            check_finite_loss(value, step, self.checkpoints.last_good)
        unread.clear()
        return values

    def num_parameters(self) -> int:
        total = sum(p.numel() for _, p in self.engine.named_parameters())
        if dist.is_initialized() and dist.get_world_size() > 1:
            return self.engine.global_num_parameters(total)
        return total

    def save_config(self) -> None:
        if self.is_logger:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            import yaml

            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict()))
