"""Ahead-of-time analysis of compiled programs: the chip table, TPU topologies, collectives
counted from compiled HLO with loop trip counts, and the roofline step-time estimate.

Pure functions over text and numbers: nothing here builds a mesh, lowers or runs a program
(``jobs/compile.py`` does that); design in docs/scale.md.
"""
