"""Cross-field rules of the mixture-of-experts section and expert parallelism.

``validate_moe(cfg)`` checks ``model.moe`` and ``parallel.ep`` against the model and the
layout; ``validate_moe_runtime(cfg, runtime)`` what the resolved device cannot serve with
experts split over ranks. Each failure is one ``ConfigError`` line naming the field,
the value and the fix, raised before any process group starts.
"""

from __future__ import annotations

from attnres_dist.config.schema import COMPILED, LOAD_BALANCING, Config
from attnres_dist.errors import ConfigError

ROUTER_DTYPES = ("fp32", "fp64", "model")
DISPATCHERS = ("alltoall", "allgather")


def _require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise ConfigError(where, message)


def validate_moe(cfg: Config) -> None:
    m, e, p = cfg.model, cfg.model.moe, cfg.parallel
    _require(p.ep >= 1, "parallel.ep", f"got {p.ep}; must be >= 1")
    _require(e.num_experts >= 0, "model.moe.num_experts", f"got {e.num_experts}; must be >= 0")
    if not e.enabled:
        _require(
            p.ep == 1,
            "parallel.ep",
            f"got {p.ep}; expert parallelism needs experts: set model.moe.num_experts or ep=1",
        )
        return
    _require(
        1 <= e.top_k <= e.num_experts,
        "model.moe.top_k",
        f"got {e.top_k}; must be in [1, model.moe.num_experts={e.num_experts}]",
    )
    for name in ("expert_ffn_hidden_size", "shared_expert_ffn_hidden_size"):
        value = getattr(e, name)
        _require(value is None or value >= 1, f"model.moe.{name}", f"got {value}; must be >= 1")
    _require(
        0 <= e.dense_layers <= m.num_layers,
        "model.moe.dense_layers",
        f"got {e.dense_layers}; must be in [0, model.num_layers={m.num_layers}]",
    )
    if e.pattern is not None:
        _require(
            len(e.pattern) == m.num_layers and set(e.pattern) <= {0, 1},
            "model.moe.pattern",
            f"got {e.pattern}; need model.num_layers={m.num_layers} entries of 1 (MoE) or 0 "
            "(dense), or null to use model.moe.dense_layers",
        )
    _require(
        e.load_balancing in LOAD_BALANCING,
        "model.moe.load_balancing",
        f"got {e.load_balancing!r}; allowed: {', '.join(LOAD_BALANCING)}",
    )
    _require(
        e.aux_loss_coeff >= 0, "model.moe.aux_loss_coeff", f"got {e.aux_loss_coeff}; must be >= 0"
    )
    _require(
        e.z_loss_coeff is None or e.z_loss_coeff >= 0,
        "model.moe.z_loss_coeff",
        f"got {e.z_loss_coeff}; must be >= 0, or null for none",
    )
    _require(
        e.capacity_factor is None or e.capacity_factor > 0,
        "model.moe.capacity_factor",
        f"got {e.capacity_factor}; must be > 0, or null for dropless routing",
    )
    _require(
        e.pre_softmax or e.top_k > 1,
        "model.moe.router_pre_softmax",
        "false at top_k 1 weights the expert by a softmax over its one logit, which is 1 and "
        "has no gradient; set it to true or null",
    )
    _require(
        e.router_dtype in ROUTER_DTYPES,
        "model.moe.router_dtype",
        f"got {e.router_dtype!r}; allowed: {', '.join(ROUTER_DTYPES)}",
    )
    _require(
        e.token_dispatcher in DISPATCHERS,
        "model.moe.token_dispatcher",
        f"got {e.token_dispatcher!r}; allowed: {', '.join(DISPATCHERS)} (flex needs DeepEP on "
        "a GPU)",
    )
    _require(
        p.dp % p.ep == 0,
        "parallel.ep",
        f"got {p.ep}; experts are split over data-parallel ranks, so ep must divide "
        f"parallel.dp={p.dp}",
    )
    _require(
        e.num_experts % p.ep == 0,
        "parallel.ep",
        f"got {p.ep}; must divide model.moe.num_experts={e.num_experts} (each rank holds "
        "num_experts / ep experts)",
    )
    _require(
        p.tp == 1 or p.sequence_parallel,
        "parallel.tp",
        f"got {p.tp}; MoE layers with tp > 1 need sequence parallelism (Megatron requires it): "
        "set parallel.sequence_parallel=true, or parallel.tp=1",
    )
    _require(
        cfg.runtime.compile not in COMPILED,
        "runtime.compile",
        f"got {cfg.runtime.compile!r}; Megatron's MoE layer reads its routing's token counts "
        "on the host (a graph break), so MoE layers run eagerly; set runtime.compile=off",
    )
    _require(
        cfg.runtime.layer_spec != "te",
        "runtime.layer_spec",
        "got 'te'; the MoE layers run Megatron's local spec (SequentialMLP experts); "
        "set runtime.layer_spec=local or auto",
    )


def validate_moe_runtime(cfg: Config, runtime) -> None:
    """What expert parallelism cannot run on the resolved device."""
    p = cfg.parallel
    if p.ep == 1:
        return
    dispatcher = cfg.model.moe.token_dispatcher
    _require(
        not (dispatcher == "alltoall" and p.tp > 1 and runtime.device.value == "cpu"),
        "model.moe.token_dispatcher",
        f"got 'alltoall' with parallel.tp={p.tp} and ep={p.ep} on the CPU: it gathers uneven "
        "token counts over the tensor group, which gloo's all_gather does not run; set "
        "model.moe.token_dispatcher=allgather",
    )
