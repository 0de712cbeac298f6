"""Where a run's numbers go: JSONL lines, TensorBoard events, Weights & Biases, a progress bar.

Only the logging rank (global rank 0) writes; the others get a writer that does nothing, so
call sites need no rank checks. Weights & Biases is used when ``output.wandb`` names a project
(``check_wandb`` refuses the run before it starts when the package is missing); its mode
(online, offline) is W&B's own ``WANDB_MODE``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from attnres_dist.errors import ConfigError


def skip_wandb_unless_used(project: str | None) -> None:
    """Keep this process from importing wandb when the run logs nothing to it.

    Megatron-Core imports wandb at its own import wherever the package is installed (for its
    inference engine's metrics), 0.9-1.6 s of every rank's start-up here, which a run without
    ``output.wandb`` never uses. ``sys.modules["wandb"] = None`` is Python's mark for "not
    importable": every ``import wandb`` in this process then raises ImportError, which Megatron
    (and ``importlib.util.find_spec``) read as not installed. Call it before Megatron is
    imported; it changes nothing once wandb is imported or when a project is named."""
    if project is None and "wandb" not in sys.modules:
        sys.modules["wandb"] = None


def check_wandb(project: str | None) -> None:
    """Refuse ``output.wandb`` when the wandb package is not importable."""
    if project is None:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError(
            "output.wandb",
            f"is {project!r} but wandb is not installed; "
            "pip install wandb, or set output.wandb=null",
        ) from None


class MetricsWriter:
    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        tensorboard: bool = True,
        progress: bool = True,
        enabled: bool = True,
        wandb_project: str | None = None,
        config: dict | None = None,
    ):
        self.enabled = enabled
        self.start = time.perf_counter()
        self._tb = None
        self._bar = None
        self._wandb = None
        if not enabled:
            return
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if wandb_project is not None:
            import wandb

            self._wandb = wandb.init(
                project=wandb_project,
                name=self.run_dir.name,
                dir=str(self.run_dir),
                config=config,
                resume="allow",
            )
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)

    def log(self, step: int, kind: str, **values) -> None:
        if not self.enabled:
            return
        record = {"step": step, "kind": kind, "time_s": round(time.perf_counter() - self.start, 3)}
        record.update(values)
        self._jsonl.write(json.dumps(record) + "\n")
        scalars = {
            f"{kind}/{key}": value
            for key, value in values.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None and scalars:
            self._wandb.log(scalars, step=step)

    def progress(self, step: int, **postfix) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._jsonl.close()
