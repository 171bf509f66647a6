"""One module per job (sft, rl, sample; the RL evaluation) and the dispatch ``main.py`` uses."""
