"""Launch recipes: the command text that starts ``main.py`` on a cluster, rendered for given sizes.

Each recipe is a pure function of explicit sizes and places (names, zones, images come from the
caller) returning text to save and run: ``tpu_pod`` and ``multislice`` (bash scripts around
``gcloud``), ``slurm_gpu`` (an sbatch script), ``gke_jobset`` (JobSet YAML). Bad input raises
``RecipeError`` naming the value and the rule. ``launch/recipes/render.py`` is the command line.
None of them has been run on real hardware yet (see BUILD_NOTES.md).
"""

from meshrl.launch.recipes.common import RecipeError
from meshrl.launch.recipes.jobset import gke_jobset
from meshrl.launch.recipes.slurm import slurm_gpu
from meshrl.launch.recipes.tpu import multislice, tpu_pod

__all__ = ["RecipeError", "gke_jobset", "multislice", "slurm_gpu", "tpu_pod"]
