"""Sweep files for ``launch/sweep.py``: each sets ``CONFIG`` and defines ``sweep()`` (a config
file may instead define ``get_sweep(hyper)``, see ``launch/sweep_load.py``)."""
