"""Documents inside a sample: Megatron's attention mask, position ids and loss mask.

A sample is cut from the EOD-separated token stream, so it may hold the end of one document and
the start of the next. Megatron's ``reset_position_ids``, ``reset_attention_mask`` and
``eod_mask_loss`` (``megatron.core.datasets.gpt_dataset._get_ltor_masks_and_position_ids``)
decide what the model makes of that:

* a token belongs to the document of the last EOD *before* it; the EOD itself ends its document;
* ``reset_attention_mask``: a token attends only to earlier tokens of its own document;
* ``reset_position_ids``: positions restart at 0 on the token after each EOD;
* ``eod_mask_loss``: the prediction made at an input EOD (the next document's first token)
  carries no loss.

``ltor_masks`` computes the same tensors as Megatron's per-sample loop for a whole batch at
once, on the tokens' device. The attention mask keeps Megatron's convention: bool
``[b, 1, s, s]``, True = masked out. The model calls it wherever the tokens are (every pipeline
stage receives them when a per-sample mask or position is needed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DocumentOptions:
    """The run's document options and the EOD id they key on."""

    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @property
    def per_sample(self) -> bool:
        """True when attention needs the tokens (per-sample mask or positions)."""
        return self.reset_position_ids or self.reset_attention_mask


@dataclass(frozen=True)
class DocumentLayout:
    """Per-sample attention inputs of one micro-batch, and the tokens they were made from (a
    pipeline stage hands the tokens on; the next one rebuilds the rest)."""

    tokens: torch.Tensor  # [b, s] input ids
    position_ids: torch.Tensor  # [b, s] long
    attention_mask: torch.Tensor | None  # [b, 1, s, s] bool, True = masked; None = causal


def causal_mask(seq_len: int, device) -> torch.Tensor:
    """``[s, s]`` bool, True above the diagonal (a token never sees later tokens)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)


def ltor_masks(
    tokens: torch.Tensor,
    eod: int,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(attention_mask ``[b, 1, s, s]`` bool, loss_mask ``[b, s]`` float, position_ids ``[b, s]``)
    of input tokens ``[b, s]``, with Megatron's meanings (module docstring)."""
    b, s = tokens.shape
    device = tokens.device
    is_eod = tokens == eod
    positions = torch.arange(s, device=device).expand(b, s)
    mask = causal_mask(s, device).expand(b, 1, s, s)
    if reset_attention_mask:
        # document index of each token: EODs strictly before it
        doc = torch.cumsum(is_eod.long(), dim=1) - is_eod.long()
        mask = mask | (doc[:, None, :, None] != doc[:, None, None, :])
    if reset_position_ids:
        # first position of each token's document: one past the last EOD before it
        after_eod = torch.zeros_like(is_eod)
        after_eod[:, 1:] = is_eod[:, :-1]
        starts = torch.where(after_eod, positions, torch.zeros_like(positions))
        positions = positions - torch.cummax(starts, dim=1).values
    loss_mask = torch.ones(b, s, dtype=torch.float, device=device)
    if eod_mask_loss:
        loss_mask = loss_mask.masked_fill(is_eod, 0.0)
    return mask.contiguous(), loss_mask, positions.contiguous()


def document_layout(tokens: torch.Tensor, options: DocumentOptions) -> DocumentLayout:
    """The attention inputs the options ask for (``options.per_sample`` must be True)."""
    mask, _, positions = ltor_masks(
        tokens, options.eod, options.reset_position_ids, options.reset_attention_mask
    )
    return DocumentLayout(tokens, positions, mask if options.reset_attention_mask else None)


def loss_mask(tokens: torch.Tensor, options: DocumentOptions | None) -> torch.Tensor | None:
    """``[b, s]`` float loss mask of input tokens, or None when every position counts."""
    if options is None or not options.eod_mask_loss:
        return None
    return (tokens != options.eod).float()
