"""One name per parameter, whatever the layout.

The single-process model's parameter names (``embedding.*``, ``layers.{i}.*``, ``final.*``,
``output.*``) are canonical. DeepSpeed's pipeline module names its parts by list index
(``{i+1}.block.*`` for layer ``i``) and keeps tied modules under ``tied_modules.{key}``; this
module maps those names to the canonical ones, so checkpoints, export and tests compare like
with like across any number of stages.
"""

from __future__ import annotations


def canonical_name(pipeline_name: str, num_layers: int) -> str:
    if pipeline_name.startswith("tied_modules.embed.embedding."):
        return "embedding." + pipeline_name[len("tied_modules.embed.embedding.") :]
    index, _, rest = pipeline_name.partition(".")
    if not index.isdigit():
        raise ValueError(f"unexpected pipeline parameter name {pipeline_name!r}")
    index = int(index)
    part, _, tail = rest.partition(".")
    if index == 0 and part == "embedding":
        return "embedding." + tail
    if 1 <= index <= num_layers and part == "block":
        return f"layers.{index - 1}.{tail}"
    if index == num_layers + 1 and part == "final":
        return "final." + tail
    if index == num_layers + 2 and part == "output":
        return "output." + tail
    raise ValueError(f"unexpected pipeline parameter name {pipeline_name!r}")
