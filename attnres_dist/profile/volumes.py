"""Communication volumes from formulas alone: the paper's pipeline analysis and the contract.

Paper (DESIGN.md section 3): with P physical stages, V virtual stages per rank, C = P * V chunks
and N_p blocks produced per chunk, sending every earlier block at every boundary ("naive") costs
``C (C - 1) / 2 * N_p * d`` per token, and cross-stage caching (each rank keeps the blocks it
already received for its later virtual stages) costs ``P (P - 1) / 2 * N_p * d +
(V - 1) * P^2 * N_p * d``. Both count completed blocks only.

This project's contract (``attnres_dist.pipeline.contract``) is exact for the run: each
boundary carries every completed block *including* the embedding ``b_0`` and, inside a block,
the partial block. ``mode_specs`` evaluates it for baseline, Full and Block AttnRes of the same
model, which is what the side-by-side bytes plot shows; no process is needed for any of it.
"""

from __future__ import annotations

import dataclasses

import torch

from attnres_dist.pipeline.contract import BoundarySpec, boundary_specs
from attnres_dist.pipeline.partition import compute_parts

PAPER_WHAT_IF = {"P": 4, "V": 2, "N": 8}  # the paper's pipeline example; N ~ 8 blocks


def naive_volume(P: int, V: int, n_p: float) -> float:
    """Tensors of size d per token sent in one forward pass, every boundary resending all."""
    chunks = P * V
    return chunks * (chunks - 1) / 2 * n_p


def caching_volume(P: int, V: int, n_p: float) -> float:
    """Same with cross-stage caching: only new blocks cross after the first round."""
    return P * (P - 1) / 2 * n_p + (V - 1) * P * P * n_p


def what_if_row(P: int, V: int, N: int, hidden: int, itemsize: int) -> dict:
    """Volumes for P stages, V virtual stages, N blocks in total (N_p = N / (P V) per chunk)."""
    n_p = N / (P * V)
    naive, caching = naive_volume(P, V, n_p), caching_volume(P, V, n_p)
    per_d = hidden * itemsize
    return {
        "P": P,
        "V": V,
        "N": N,
        "chunks": P * V,
        "N_p": n_p,
        "naive_d_per_token": naive,
        "caching_d_per_token": caching,
        "naive_bytes_per_token": naive * per_d,
        "caching_bytes_per_token": caching * per_d,
        "caching_over_naive": caching / naive if naive else float("nan"),
    }


def parse_what_if(text: str) -> dict:
    """``"P=4,V=2,N=8"`` -> {"P": 4, "V": 2, "N": 8}; missing keys take the paper's values."""
    out = dict(PAPER_WHAT_IF)
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().upper()
        if not sep or key not in out or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"what-if {text!r}: expected P=<int>,V=<int>,N=<int>, each >= 1")
        out[key] = int(value)
    return out


def run_volumes(cfg, specs: list[BoundarySpec], what_ifs: list[dict]) -> dict:
    """Analytic volumes of the run (V = 1) next to the contract's, plus the what-if rows."""
    m = cfg.model
    plan = m.block_plan()
    itemsize = getattr(torch, specs[0].dtype).itemsize if specs else 4  # the payload's dtype
    P = cfg.parallel.pp
    blocks = plan.num_blocks if plan.mode != "baseline" else 0
    contract_d = sum(s.num_tensors for s in specs)  # tensors of size d per token, all cuts
    if plan.mode == "baseline":  # no blocks: the formulas do not apply, one state per cut
        run_row = what_if_row(P, 1, 0, m.hidden_size, itemsize)
    else:
        run_row = what_if_row(P, 1, blocks, m.hidden_size, itemsize)
    return {
        "run": run_row | {"mode": plan.mode, "blocks": blocks},
        "contract_d_per_token": contract_d,
        "contract_bytes_per_token": sum(s.bytes_forward for s in specs)
        // (m.seq_length * cfg.train.micro_batch_size),
        "what_if": [what_if_row(w["P"], w["V"], w["N"], m.hidden_size, itemsize) for w in what_ifs],
    }


def mode_specs(cfg, vocab_size: int) -> dict[str, list[dict]]:
    """Boundary specs of the run's model as baseline, Full and Block AttnRes (same partition)."""
    out = {}
    m = cfg.model
    for mode in ("baseline", "full", "block"):
        size = min(m.attnres.block_size, 2 * m.num_layers)  # the run's S, valid in any mode
        attnres = dataclasses.replace(m.attnres, mode=mode, block_size=size)
        model = dataclasses.replace(m, attnres=attnres)
        parts = compute_parts(model, cfg.parallel.pp, cfg.parallel.partition, vocab_size)
        specs = boundary_specs(
            model.block_plan(),
            parts,
            m.seq_length,
            cfg.train.micro_batch_size,
            m.hidden_size,
            torch.float32,
        )
        label = mode if mode != "block" else f"block (S={model.attnres.block_size})"
        out[label] = [s.to_dict() for s in specs]
    return out
