"""meshrl: JAX-first RL post-training of LLMs on a named device mesh.

Importing meshrl (or any subpackage) never initialises a JAX backend, creates a mesh or calls
``jax.distributed.initialize``; ``main.py`` does those explicitly.
"""

__version__ = "0.1.0"
