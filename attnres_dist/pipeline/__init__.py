"""attnres_dist: pipeline-parallel trainer for Attention-Residual Transformers."""
