"""attnres_dist: pipeline-parallel trainer for Attention-Residual Transformers."""

from attnres_dist import megatron_jit

# before any module of the package imports Megatron-Core (see megatron_jit)
megatron_jit.install()
