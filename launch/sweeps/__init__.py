"""Sweep files for ``launch/sweep.py``: each sets ``CONFIG`` and defines ``sweep()``."""
