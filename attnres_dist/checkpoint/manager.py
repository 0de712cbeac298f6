"""The trainer's checkpointing: where checkpoints go, which one a run resumes, when to save.

``Checkpointing(cfg, signature, tokenizer)`` is built before any process group starts, so a
missing, damaged or foreign checkpoint is a one-line error (exit 2) like any other bad input.
``checkpoint.resume``:

* ``auto``: the newest intact checkpoint in ``checkpoint.dir`` (default
  ``<output.run_dir>/checkpoints``); a fresh start when there is none. Damaged ones are named
  in a warning and skipped.
* ``none``: a fresh start (later saves still go to ``checkpoint.dir``).
* a path: that checkpoint, or the newest intact one in that directory of checkpoints or run
  directory. Saves go to this run's ``checkpoint.dir``.
"""

from __future__ import annotations

from pathlib import Path

from attnres_dist.checkpoint import store
from attnres_dist.checkpoint.state import check_signature, model_signature


def checkpoint_root(cfg) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.output.run_dir) / "checkpoints")


class Checkpointing:
    def __init__(self, cfg, signature: dict, tokenizer: dict):
        self.cfg = cfg
        self.root = checkpoint_root(cfg)
        self.signature = signature
        self.tokenizer = tokenizer
        self.warnings: list[str] = []
        self.resume_from = self._resolve()
        self.last_good: tuple[Path, int] | None = None
        if self.resume_from is not None:
            self.last_good = (self.resume_from.path, self.resume_from.step)

    @classmethod
    def for_run(cls, cfg, meta: dict, vocab: int, tp: int) -> Checkpointing:
        """For a run on the dataset described by ``meta`` with a model vocabulary of ``vocab``."""
        from attnres_dist.model.megatron_config import padded_vocab_size

        padded = padded_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, tp)
        tokenizer = {
            "kind": meta.get("tokenizer", "bytes"),
            "path": meta.get("tokenizer_path"),
            "vocab_size": int(meta["vocab_size"]),
            "eod": meta.get("eod"),
        }
        return cls(cfg, model_signature(cfg.model, padded), tokenizer)

    def _resolve(self) -> store.Checkpoint | None:
        resume = self.cfg.checkpoint.resume
        if resume == "none":
            return None
        if resume == "auto":
            ckpt = store.newest_valid(self.root, self.warnings.append)
        else:
            ckpt = store.resolve(resume, self.warnings.append)
        if ckpt is not None:
            check_signature(ckpt, self.signature)
            self._check_data_position(ckpt)
        return ckpt

    def _check_data_position(self, ckpt: store.Checkpoint) -> None:
        """Batches are a function of (step, global batch size, seed, windows): say when the
        resumed run will not continue the checkpoint's data order."""
        theirs = ckpt.manifest.get("data", {})
        for key, ours in self._data_position(ckpt.step).items():
            if key != "step" and key in theirs and theirs[key] != ours:
                self.warnings.append(
                    f"{ckpt.path}: written with {key}={theirs[key]}, this run has {ours}; "
                    "training continues from its step but not in its data order"
                )

    def _data_position(self, step: int) -> dict:
        t = self.cfg.train
        return {
            "step": step,
            "consumed_samples": step * t.global_batch_size,
            "global_batch_size": t.global_batch_size,
            "seed": t.seed,
            "seq_length": self.cfg.model.seq_length,
            "data_path": self.cfg.data.path,
        }

    # -- during training (collective) ------------------------------------------------------

    def restore(self, engine, dims, rank: int) -> tuple[int, str | None]:
        """Load the resolved checkpoint into ``engine``; (step to continue from, note)."""
        if self.resume_from is None:
            return 0, None
        from attnres_dist.checkpoint.state import load_checkpoint

        note = load_checkpoint(self.resume_from, engine, dims, rank)
        return self.resume_from.step, note

    def due(self, step: int, total_steps: int) -> bool:
        every = self.cfg.checkpoint.every
        return step == total_steps or (every > 0 and step % every == 0)

    def save(self, step: int, engine, dims, rank: int) -> Path:
        from attnres_dist.checkpoint.state import save_checkpoint

        body = {
            "config": self.cfg.to_dict(),
            "model": self.signature,
            "tokenizer": self.tokenizer,
            "data": self._data_position(step),
        }
        path = save_checkpoint(
            self.root, step, engine, dims, rank, body, self.cfg.checkpoint.keep_last
        )
        self.last_good = (path, step)
        return path
