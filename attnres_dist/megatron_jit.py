"""Megatron-Core's ``jit_fuser`` switched off the moment it is defined, before any layer uses it.

``megatron.core.jit`` sets ``jit_fuser = torch.compile`` when it is imported, and a dozen of
Megatron's modules decorate helper functions with it as they are imported in turn (the bias-GeLU
and bias-SwiGLU fusions, ``activations``, ``TorchL2Norm``, attention's output gate, MoE routing).
In torch 2.13 the decoration alone imports TorchDynamo and Inductor: 3.6 s of the 10 s a process
spends importing Megatron-Core and DeepSpeed on a 2-core host, paid by every rank of every job
(and every test's job). None of those functions runs in this project's models:
``model/megatron_config.py`` turns off every fusion that would call them
(``bias_activation_fusion``, ``bias_dropout_fusion``, ``apply_rope_fusion``), and the model uses
neither L2-normalised queries, output gates nor MoE.

So :func:`install` puts a finder first on ``sys.meta_path`` that loads ``megatron.core.jit`` as
usual and then calls that module's own ``disable_jit_fuser()`` (Megatron's switch, which makes
``jit_fuser`` a no-op decorator), before the modules that import ``jit_fuser`` read it. The
package imports this module first, so any process that imports ``attnres_dist`` before
Megatron-Core gets it; Megatron imported earlier is left as it was.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

JIT_MODULE = "megatron.core.jit"


class _JitFuserOff(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``megatron.core.jit`` where the path finder would and runs it, then switches its
    ``jit_fuser`` off; every other name is left to the finders after it."""

    def find_spec(self, name, path, target=None):
        if name != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        module.disable_jit_fuser()


def install() -> None:
    """Idempotent; does nothing once Megatron's ``jit`` module is loaded (too late to matter)."""
    if JIT_MODULE in sys.modules or any(isinstance(f, _JitFuserOff) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _JitFuserOff())
