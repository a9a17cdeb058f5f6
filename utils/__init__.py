"""Scaling Labs: the one package that notebooks, workers and the grader import.

Modules and what each owns: docs/DESIGN.md (its module table).
"""

__version__ = "0.1.0"
