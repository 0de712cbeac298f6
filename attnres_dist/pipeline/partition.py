"""Which pipeline stage owns which parts of the model: pure functions, no process group.

The model is a list of parts ``[embedding, layer_0 .. layer_{n-1}, final, head]`` (list index
``i + 1`` is transformer layer ``i``). A partition is DeepSpeed's ``parts`` list: stage ``p``
owns list indices ``parts[p] .. parts[p+1]-1``. Methods:

* ``uniform``: transformer layers spread evenly (earlier stages take the remainder); the
  embedding stays with the first stage and final aggregation + head with the last.
* ``parameters``: DeepSpeed's balanced partition of per-part parameter counts.
* ``[c_0, ..., c_{P-1}]``: explicit transformer layers per stage.
"""

from __future__ import annotations

from attnres_dist.config import ModelConfig


def layer_counts_uniform(num_layers: int, pp: int) -> list[int]:
    base, extra = divmod(num_layers, pp)
    return [base + (1 if stage < extra else 0) for stage in range(pp)]


def parts_from_counts(counts: list[int]) -> list[int]:
    """DeepSpeed ``parts`` for explicit transformer-layer counts per stage."""
    parts, end = [0], 1  # the embedding (index 0) rides with the first stage
    for count in counts[:-1]:
        end += count
        parts.append(end)
    parts.append(sum(counts) + 3)
    return parts


def part_param_counts(model: ModelConfig, vocab_size: int) -> list[int]:
    """Parameters of each model part, from the config alone (nothing is built)."""
    h, ffn = model.hidden_size, model.ffn_size
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    head_dim = h // heads
    qkv = h * (heads + 2 * groups) * head_dim
    attnres = 4 * h if model.attnres.mode != "baseline" else 0
    layer = 2 * h + qkv + heads * head_dim * h + 2 * ffn * h + ffn * h + attnres
    final = h + (2 * h if model.block_plan().has_final_mix else 0)
    head = vocab_size * h if not model.tie_embeddings else 0
    return [vocab_size * h] + [layer] * model.num_layers + [final, head]


def compute_parts(model: ModelConfig, pp: int, partition, vocab_size: int) -> list[int]:
    if isinstance(partition, list):
        return parts_from_counts(partition)
    if partition == "uniform":
        return parts_from_counts(layer_counts_uniform(model.num_layers, pp))
    if partition == "parameters":
        from deepspeed.runtime.utils import partition_balanced

        return partition_balanced(weights=part_param_counts(model, vocab_size), num_parts=pp)
    raise ValueError(f"unknown partition method {partition!r}")


def stage_of_part(parts: list[int], index: int) -> int:
    for stage in range(len(parts) - 1):
        if parts[stage] <= index < parts[stage + 1]:
            return stage
    raise ValueError(f"part {index} outside the partition {parts}")


def describe_parts(parts: list[int], num_layers: int) -> list[str]:
    """Human-readable ownership per stage, e.g. ``embedding, layers 0-2``."""
    lines = []
    for stage in range(len(parts) - 1):
        names = []
        layer_ids = [i - 1 for i in range(parts[stage], parts[stage + 1]) if 1 <= i <= num_layers]
        if parts[stage] == 0:
            names.append("embedding")
        if layer_ids:
            names.append(f"layers {layer_ids[0]}-{layer_ids[-1]}")
        if parts[stage] <= num_layers + 1 < parts[stage + 1]:
            names.append("final aggregation")
        if parts[stage] <= num_layers + 2 < parts[stage + 1]:
            names.append("lm head + loss")
        lines.append(f"stage {stage}: " + ", ".join(names or ["(nothing)"]))
    return lines
