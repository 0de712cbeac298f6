"""The inter-stage activation contract: what crosses each pipeline boundary, and how.

At a cut after ``j`` transformer layers the receiving stage needs every completed block
representation plus the partial block, because every later sublayer attends over all of them.
The sender sends ONE tensor ``[k, s, b, h]``: its block store (already one tensor) with the
partial block as the last row; the receiver checks it against the block plan and takes views of
it. One tensor, not a tuple: DeepSpeed
back-propagates a tuple payload one element at a time and its checkpointing crashes on tuples
(DESIGN.md section 3). ``k`` per boundary is fixed by the config, so shapes are sent once.
Baseline carries the single hidden state (``k = 1``); a cut between the final aggregation and
the head carries the final hidden state ``[s, b, h]``.

``boundary_specs`` reports, for any config, each boundary's shape and bytes per micro-batch in
both directions (the gradient sent back has the payload's shape).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from attnres_dist.config.block_plan import BlockPlan
from attnres_dist.model.depth_state import DepthState


class PayloadError(RuntimeError):
    """A received payload that disagrees with the block plan."""


def pack(state: DepthState) -> torch.Tensor:
    """The state as one ``[k, s, b, h]``: the block store with the partial block as its last
    row (written into the store's buffer: no copy of the completed blocks)."""
    return state.payload()


def check_payload(payload, expected: int, message: Callable[[object], str]) -> None:
    """Raise ``PayloadError(message(got))`` unless ``payload`` is one ``[expected, s, b, h]``
    tensor; ``got`` is its shape, or its type when it is not a tensor."""
    if not torch.is_tensor(payload) or payload.dim() != 4 or payload.shape[0] != expected:
        got = tuple(payload.shape) if torch.is_tensor(payload) else type(payload).__name__
        raise PayloadError(message(got))


def unpack(
    payload: torch.Tensor,
    plan: BlockPlan,
    layers_done: int,
    boundary: str,
    capacity: int | None = None,
) -> DepthState:
    """One ``[k, s, b, h]`` tensor -> the DepthState after ``layers_done`` layers; with
    ``capacity`` (the rows the receiving layers' store grows to) its blocks are copied into a
    store buffer (``DepthState.adopt_payload``), else the state holds views of the payload."""
    completed, has_partial = plan.state_after(2 * layers_done)
    expected = completed + int(has_partial)
    check_payload(
        payload,
        expected,
        lambda got: (
            f"{boundary}: received payload {got}, but the block plan ({plan.describe()}) "
            f"puts {expected} tensors [k={expected}, s, b, h] at the cut after {layers_done} layers"
        ),
    )
    if capacity is not None:
        return DepthState.adopt_payload(payload, completed, has_partial, layers_done, capacity)
    return DepthState.from_payload(payload, completed, has_partial, layers_done)


@dataclass(frozen=True)
class BoundarySpec:
    sender: int  # pipeline stage
    receiver: int
    layers_before: int  # transformer layers applied before the cut
    kind: str  # "blocks" ([k, s, b, h]) or "hidden" ([s, b, h], before the head)
    shape: tuple[int, ...]
    dtype: str
    bytes_forward: int  # activation payload per micro-batch
    bytes_backward: int  # gradient payload per micro-batch

    @property
    def num_tensors(self) -> int:
        return self.shape[0] if self.kind == "blocks" else 1

    @property
    def name(self) -> str:
        return f"stage {self.sender} -> {self.receiver} (after {self.layers_before} layers)"

    def to_dict(self) -> dict:
        return asdict(self) | {"num_tensors": self.num_tensors, "name": self.name}


def boundary_specs(
    plan: BlockPlan,
    parts: list[int],
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    dtype: torch.dtype = torch.float32,
) -> list[BoundarySpec]:
    """The payload of every stage boundary of a partition (DeepSpeed ``parts``)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    specs = []
    for stage in range(len(parts) - 2):
        first_of_next = parts[stage + 1]  # model-part index that starts the next stage
        layers_before = min(first_of_next - 1, plan.num_layers)
        if first_of_next <= plan.num_layers + 1:  # next stage starts with a layer or final
            k = plan.boundary_width(layers_before)
            shape, kind = (k, seq_length, micro_batch_size, hidden_size), "blocks"
        else:  # next stage starts with the head: the final hidden state
            shape, kind = (seq_length, micro_batch_size, hidden_size), "hidden"
        nbytes = itemsize
        for dim in shape:
            nbytes *= dim
        specs.append(
            BoundarySpec(
                stage,
                stage + 1,
                layers_before,
                kind,
                shape,
                str(dtype).split(".")[-1],
                nbytes,
                nbytes,
            )
        )
    return specs


def boundary_specs_for_config(cfg, vocab_size: int, dtype: torch.dtype = torch.float32):
    """``boundary_specs`` for a full run Config (partition computed as the trainer does)."""
    from attnres_dist.pipeline.partition import compute_parts

    m = cfg.model
    parts = compute_parts(m, cfg.parallel.pp, cfg.parallel.partition, vocab_size)
    return boundary_specs(
        m.block_plan(),
        parts,
        cfg.local_seq_length,
        cfg.train.micro_batch_size,
        m.hidden_size,
        dtype,
    )


def format_specs(specs: list[BoundarySpec]) -> str:
    """A markdown table of the boundaries."""
    rows = [
        "| boundary | tensors | shape | bytes fwd / micro-batch | bytes bwd / micro-batch |",
        "|---|---|---|---|---|",
    ]
    for spec in specs:
        rows.append(
            f"| {spec.name} | {spec.num_tensors} | {list(spec.shape)} | "
            f"{spec.bytes_forward:,} | {spec.bytes_backward:,} |"
        )
    return "\n".join(rows)
