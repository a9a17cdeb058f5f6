"""The grader puts this folder first on PYTHONPATH while a submission runs (see sitecustomize.py)."""
