"""Scaling Labs: the one package that notebooks, workers and the grader import.

Modules: config (profiles), device, data, models, train (THE loop), bench, dist, optim,
schedules, monitor, plots, checks, grader, authoring.
"""
__version__ = "0.1.0"
