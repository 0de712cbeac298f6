"""The block plan: the one place that knows the shape of the depth-attention state.

From (num_layers, mode, block_size) it derives, for every sublayer, how many sources it attends
over and whether it closes a block; what the final aggregation reads; and, for any cut between
two transformer layers, how many ``[s, b, h]`` tensors cross it. The model, the pipeline
contract, the profiler and the tests all ask this module instead of re-deriving the rules.

Sublayers are numbered 1..L (``L = 2 * num_layers``; sublayer ``2i+1`` is layer i's attention,
``2i+2`` its MLP); source 0 is the embedding. The state between sublayers is a list of completed
block representations plus an optional partial block (DESIGN.md section 2):

* ``full``: every sublayer closes its own block, so the completed list is ``[v_0, ..., v_{l-1}]``.
* ``block`` with size S: sublayers ``(n-1)S+1 .. nS`` form block n; block n's representation is
  the sum of their outputs; the last block may be shorter.
* ``baseline``: the standard residual stream; one tensor (the running hidden state) is carried.
* ``delta_full`` / ``delta_block`` (Delta AttnRes, arXiv 2605.18855): the same state as
  ``full`` / ``block``, read differently: a sublayer's input is the residual stream (the sum of
  every completed block and the partial one) plus a mix over the *completed* blocks only, and
  the final norm reads the stream (no final mix). The stream is derived from the state, so a
  stage boundary carries exactly what Full or Block carries (docs/architecture.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

from attnres_dist.errors import ConfigError

MODES = ("baseline", "full", "block", "delta_full", "delta_block")
BLOCK_MODES = ("block", "delta_block")  # the modes that read ``block_size``


@dataclass(frozen=True)
class BlockPlan:
    num_layers: int
    mode: str = "block"
    block_size: int = 2

    def __post_init__(self):
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ConfigError(
                "model.num_layers", f"got {self.num_layers!r}; must be an integer >= 1"
            )
        if self.mode not in MODES:
            raise ConfigError(
                "model.attnres.mode", f"got {self.mode!r}; allowed: {', '.join(MODES)}"
            )
        if self.mode in BLOCK_MODES:
            bs = self.block_size
            if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
                raise ConfigError(
                    "model.attnres.block_size",
                    f"got {bs!r}; must be an integer >= 1 (sublayers per block; 1 = full AttnRes)",
                )
            if bs > self.num_sublayers:
                raise ConfigError(
                    "model.attnres.block_size",
                    f"got {bs}; at most 2 * num_layers = {self.num_sublayers} sublayers per block",
                )

    @property
    def num_sublayers(self) -> int:
        return 2 * self.num_layers

    @property
    def delta(self) -> bool:
        """Delta AttnRes: the mix is added to the residual stream instead of replacing it."""
        return self.mode.startswith("delta_")

    @property
    def has_final_mix(self) -> bool:
        """Whether a depth mix (its own query and key gain) precedes the final norm."""
        return self.mode in ("full", "block")

    @property
    def effective_block_size(self) -> int:
        """Sublayers per block (full = 1; baseline has no blocks and reports L)."""
        if self.mode in ("full", "delta_full"):
            return 1
        if self.mode in BLOCK_MODES:
            return self.block_size
        return self.num_sublayers

    @property
    def num_blocks(self) -> int:
        """N = ceil(L / S): blocks formed by the sublayers (the embedding block b_0 excluded)."""
        return math.ceil(self.num_sublayers / self.effective_block_size)

    def closes_block(self, sublayer: int) -> bool:
        """True if sublayer ``sublayer`` (1-based) is the last of its block."""
        self._check_sublayer(sublayer)
        if self.mode == "baseline":
            return False
        return sublayer % self.effective_block_size == 0 or sublayer == self.num_sublayers

    def state_after(self, sublayer: int) -> tuple[int, bool]:
        """(completed blocks incl. the embedding, whether a partial block exists) after it.

        ``sublayer = 0`` is the state right after the embedding. Baseline is ``(0, True)``.
        """
        if sublayer < 0 or sublayer > self.num_sublayers:
            raise ValueError(f"sublayer {sublayer} outside 0..{self.num_sublayers}")
        if self.mode == "baseline":
            return 0, True
        size = self.effective_block_size
        completed = 1 + sublayer // size
        partial = sublayer % size != 0
        if sublayer == self.num_sublayers and partial:
            completed, partial = completed + 1, False
        return completed, partial

    def num_sources(self, sublayer: int) -> int:
        """How many tensors the depth attention of sublayer ``sublayer`` (1-based) mixes:
        the completed blocks and the partial one (Delta: the completed blocks only)."""
        self._check_sublayer(sublayer)
        completed, partial = self.state_after(sublayer - 1)
        return completed + int(partial and not self.delta)

    @property
    def final_num_sources(self) -> int:
        """Tensors of the state after the last sublayer (all blocks, or all v_i): what the
        final aggregation mixes, or (Delta) sums into the stream the final norm reads."""
        completed, partial = self.state_after(self.num_sublayers)
        return completed + int(partial)

    def zero_query_scale(self, sublayer: int | None) -> Fraction:
        """What the input of the norm after ``sublayer``'s mix (None: the final norm) is, as
        a multiple of the plain residual stream, when every query is zero and the stream is
        the sum of the mixed sources: ``1 / n`` for a mix of ``n`` (the mean replaces the
        stream), ``1 + 1 / n`` for Delta (the mean is added to it), 1 for the baseline and
        Delta's final norm. Exact for Full, Block, Delta Full and a Delta Block block's first
        sublayer; inside a Delta Block block the completed blocks sum to the stream less
        the partial block (docs/checkpoints.md)."""
        if self.mode == "baseline" or (sublayer is None and self.delta):
            return Fraction(1)
        n = self.final_num_sources if sublayer is None else self.num_sources(sublayer)
        return Fraction(n + 1, n) if self.delta else Fraction(1, n)

    def boundary_width(self, layers_before: int) -> int:
        """Tensors crossing a cut after ``layers_before`` transformer layers (0..num_layers)."""
        if not 0 <= layers_before <= self.num_layers:
            raise ValueError(f"cut after {layers_before} layers outside 0..{self.num_layers}")
        completed, partial = self.state_after(2 * layers_before)
        return completed + int(partial)

    @cached_property
    def widths(self) -> tuple[int, ...]:
        """boundary_width for every cut 0..num_layers."""
        return tuple(self.boundary_width(j) for j in range(self.num_layers + 1))

    def describe(self) -> str:
        if self.mode == "baseline":
            return f"baseline residual, {self.num_layers} layers"
        final = (
            f"final aggregation over {self.final_num_sources} sources"
            if self.has_final_mix
            else "the final norm reads the residual stream"
        )
        return (
            f"{self.mode} AttnRes, {self.num_layers} layers = {self.num_sublayers} sublayers, "
            f"block size {self.effective_block_size}, {self.num_blocks} blocks, {final}"
        )

    def _check_sublayer(self, sublayer: int) -> None:
        if not 1 <= sublayer <= self.num_sublayers:
            raise ValueError(f"sublayer {sublayer} outside 1..{self.num_sublayers}")
