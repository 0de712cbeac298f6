"""The prepared GPU check: one time-boxed run that installs the project and exercises it on a GPU.

``make gpu-check`` (``launch/gpu_check.sh``) runs ``python -m gpu_check.run`` from the repository
root (outside the wheel: the GPU machine gets a copy of the repository) on a bare machine with a
CUDA torch and no network: it installs the project the way ``docker/Dockerfile`` does, from
wheels carried in ``.whl/`` (``make gpu-wheels``), then runs each step in its own process with
its own time limit, records what failed and carries on, and writes ``gpu.md`` (the numbers, the
machine, each step's status) into ``$OUT``. ``GPU_CHECK_DRY_RUN=1`` runs the same driver on a
CPU with tiny sizes (tests/test_gpu_check.py). docs/gpu.md says how to run it.

``run`` (the driver) and ``report`` use the standard library only: they run before anything is
installed. ``steps`` holds what each step does and dispatches to ``train_steps``,
``speed_step``, ``step_profile`` and ``study_step``; what they share (the step's time limit and
result file, the device, peak memory) is in ``common``, so every import points one way.
"""
