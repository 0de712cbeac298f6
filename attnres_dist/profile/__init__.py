"""Stage communication profiler: wire tap, schedule timers, link calibration, report, plots.

``attnres-dist profile`` (``runner``) measures a pipelined run; ``wire.WireTap`` is the reusable
byte counter on DeepSpeed's p2p layer that the pipeline benchmark uses as well.
"""
