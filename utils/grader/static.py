"""Static feedback on a submission's source: read, never run. Heuristics, so they only warn
(a syntax error is the one finding that stops grading, because nothing could run)."""

from __future__ import annotations

import ast
from pathlib import Path


def _name(node) -> str:
    """'torch.save' for torch.save(...), 'save' for save(...)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return f"{base}.{node.attr}" if base else node.attr
    return ""


def _mentions_rank(node) -> bool:
    text = ast.unparse(node).lower()
    return any(w in text for w in ("rank", "is_main", "main_process", "master", "is_leader", "leader"))


def _calls(tree):
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def _guarded(node, parents) -> bool:
    """Is ``node`` under an ``if`` on the rank, or after an early ``if ...rank...: return``?"""
    child, p = node, parents.get(node)
    while p is not None:
        if isinstance(p, (ast.If, ast.IfExp)) and _mentions_rank(p.test):
            return True
        if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            for stmt in p.body:
                if stmt is child or (hasattr(stmt, "lineno") and stmt.lineno >= node.lineno):
                    break
                if (
                    isinstance(stmt, ast.If)
                    and _mentions_rank(stmt.test)
                    and any(
                        isinstance(s, (ast.Return, ast.Raise))
                        or (
                            isinstance(s, ast.Expr)
                            and isinstance(s.value, ast.Call)
                            and _name(s.value.func).endswith("exit")
                        )
                        for s in stmt.body
                    )
                ):
                    return True
        child, p = p, parents.get(p)
    return False


def check_source(source: str, filename: str = "submission.py") -> dict:
    """``{"syntax_error": str | None, "warnings": [str, ...]}``."""
    try:
        tree = ast.parse(source, filename=filename)
        compile(tree, filename, "exec")
    except SyntaxError as e:
        where = f"line {e.lineno}" + (f", column {e.offset}" if e.offset else "")
        return {"syntax_error": f"{filename}, {where}: {e.msg}", "warnings": []}
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes; absurdly deep nesting
        return {"syntax_error": f"{filename}: {type(e).__name__}: {str(e)[:200]}", "warnings": []}
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    calls = _calls(tree)
    names = [_name(c.func) for c in calls]
    text = source
    warnings = []

    if not any(n.endswith("init_process_group") for n in names) and "utils.parallel" not in text:
        warnings.append(
            "never calls torch.distributed.init_process_group: the script will run as "
            "N independent copies, not one data-parallel job"
        )
    if not any(n.endswith("DistributedDataParallel") or n == "DDP" for n in names):
        warnings.append(
            "no DistributedDataParallel wrapper found: without it (or an all_reduce of the "
            "gradients by hand) the ranks do not train one model together"
        )
    uses_sampler = any(n.endswith("DistributedSampler") for n in names)
    calls_set_epoch = any(n.endswith("set_epoch") for n in names)
    calls_fit = any(n.endswith("fit") for n in names)  # utils.train.fit calls set_epoch
    if uses_sampler and not calls_set_epoch and not calls_fit:
        warnings.append(
            "DistributedSampler without set_epoch(epoch): every epoch sees the same order; "
            "call sampler.set_epoch(epoch) at the start of each epoch"
        )
    if not any(n.endswith(("manual_seed", "seed_everything", "random.seed", "np.random.seed")) for n in names):
        warnings.append(
            "no seed (torch.manual_seed): ranks may start from different weights and runs are not reproducible"
        )
    saves = [
        c
        for c in calls
        if _name(c.func).split(".")[-1] in ("save", "save_file") and not _inside_def_named(c, parents, "save")
    ]
    if saves and not any(_guarded(c, parents) for c in saves):
        line = saves[0].lineno
        warnings.append(
            f"line {line}: the model seems to be saved from every rank; save once, from rank 0 "
            "(if rank == 0: ...), or the ranks race to write one file"
        )
    return {"syntax_error": None, "warnings": warnings}


def _inside_def_named(node, parents, word: str) -> bool:
    p = parents.get(node)
    while p is not None:
        if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)) and word in p.name.lower():
            return True
        p = parents.get(p)
    return False


def check_file(path: str | Path) -> dict:
    path = Path(path)
    try:
        source = path.read_text(errors="replace")
    except OSError as e:
        return {"syntax_error": f"cannot read {path.name}: {e}", "warnings": []}
    return check_source(source, path.name)
