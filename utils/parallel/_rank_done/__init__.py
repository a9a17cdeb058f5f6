"""``parallel.torchrun`` puts this folder first on its ranks' PYTHONPATH (see sitecustomize.py)."""
