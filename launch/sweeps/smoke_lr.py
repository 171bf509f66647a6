"""2 x 2 sweep of the smoke config: two RL learning rates x two seeds (well under a minute a
trial on 2 CPU cores).

  python launch/sweep.py launch/sweeps/smoke_lr.py --workdir /tmp/meshrl_sweep --parallel 2
"""

from __future__ import annotations

from meshrl.launch import sweep as hyper

CONFIG = "configs/default.py:smoke"


def sweep() -> list[dict]:
    return hyper.product([hyper.sweep("trainer.learning_rate", [1e-3, 3e-4]),
                          hyper.sweep("trainer.seed", [0, 1])])
