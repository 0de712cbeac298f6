"""Fast-path selection: which layer spec, norm, optimizer and precision a run uses.

``select_runtime(cfg.runtime)`` probes the machine (``probes``) and resolves the config's
``runtime`` section into a ``RuntimeChoice`` with a reason per decision (``select``). The model
turns a choice into its layer spec (``attnres_dist.model.layer_specs``) and the engines into
their optimizer (``attnres_dist.optim.adam_class``).
"""

from attnres_dist.runtime.choice import Choice, RuntimeChoice
from attnres_dist.runtime.select import select_runtime

__all__ = ["Choice", "RuntimeChoice", "select_runtime"]
