"""DeepSpeed's data-parallel gradient reduction, skipped where there is one replica (dp = 1).

DeepSpeed's pipeline schedule ends every step with ``ReduceGrads``: at dp = 1 it still gathers
every gradient (the bf16 optimizer's fp32 ones, or each parameter's), flattens them into one
bucket, scales it by 1 / 1, all-reduces it over a group of one rank and copies it back: two
copies of every gradient and a collective per step, which in fp32 change nothing. Here that
instruction's handler is replaced, on this engine instance only (the way ``watchdog.py`` wraps
handlers), by one that does nothing; DeepSpeed itself is not patched.

Kept as DeepSpeed does it:

* ZeRO-1 in fp32 (``parallel.zero_stage: 1`` without bf16): its ``reduce_gradients`` also
  hands the gradients to the optimizer's partitions, which is more than a reduction;
* ``ReduceTiedGrads``: at pp = 1 DeepSpeed builds no tied group, so it loops over nothing; at
  pp > 1 the tied embedding's group holds the first and the last stage, and the sum is needed.

Under the bf16 engine the reduction was not quite the identity: DeepSpeed communicates in the
model's dtype (``communication_data_type``: bf16), so at dp = 1 it rounded the fp32
accumulated gradients to bf16 and back before the optimizer step. Skipped, the optimizer gets
the fp32 gradients the engine accumulated (with fp32 communication DeepSpeed's reduction and
the skip give bitwise the same step: ``tests/test_host_work.py``).

At fp32 ZeRO-0 DeepSpeed's reduction also gives a parameter without a gradient a zero one
before reducing; skipping it leaves such a parameter without one, so AdamW skips it, as the
single-process reference (``train/local_engine.py``) does.
"""

from __future__ import annotations


def _no_reduction(self) -> None:
    """``ReduceGrads`` over a data-parallel group of one rank: the identity."""


def skip_single_replica_reduction(engine, dp: int, zero1_fp32: bool) -> bool:
    """Replace ``engine``'s ``ReduceGrads`` handler by the identity when ``dp == 1`` (and not
    ZeRO-1 in fp32); True when it did. Call after any other per-instance wrapping."""
    from deepspeed.runtime.pipe import schedule

    if dp != 1 or zero1_fp32:
        return False
    handlers = dict(engine._INSTRUCTION_MAP)  # the instance's map, or the class's
    handlers[schedule.ReduceGrads] = _no_reduction
    engine._INSTRUCTION_MAP = handlers
    return True
