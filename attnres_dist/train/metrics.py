"""Where a run's numbers go: JSONL lines, TensorBoard events and a progress bar.

Only the rank that owns the loss (the last pipeline stage's first data/tensor rank) writes;
the others get a writer that does nothing, so call sites need no rank checks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class MetricsWriter:
    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        tensorboard: bool = True,
        progress: bool = True,
        enabled: bool = True,
    ):
        self.enabled = enabled
        self.start = time.perf_counter()
        self._tb = None
        self._bar = None
        if not enabled:
            return
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)

    def log(self, step: int, kind: str, **values) -> None:
        if not self.enabled:
            return
        record = {"step": step, "kind": kind, "time_s": round(time.perf_counter() - self.start, 3)}
        record.update(values)
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)

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
        self._jsonl.close()
