"""Fast-path selection: which layer spec, norm, optimizer and precision a run uses.

``select_runtime(cfg.runtime)`` probes the machine (``probes``) and resolves the config's
``runtime`` section into a ``RuntimeChoice`` with a reason per decision (``select``);
``kernels`` turns a choice into the objects the model and the engines build with.
"""

from attnres_dist.runtime.select import Choice, RuntimeChoice, select_runtime

__all__ = ["Choice", "RuntimeChoice", "select_runtime"]
