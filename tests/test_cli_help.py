"""Every option of the course's command-line tools says what it does in --help."""

import argparse
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


class _Parsed(Exception):
    pass


def _parser_of(main, monkeypatch) -> argparse.ArgumentParser:
    """Run main() until it parses its arguments; return that parser."""
    seen = []

    def capture(self, *a, **k):
        seen.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Parsed):
        main([])
    return seen[0]


def _benchmark_main(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, "main", None) or mod.parse_args


TOOLS = {
    "utils.ddp_train": lambda: importlib.import_module("utils.ddp_train").parse_args,
    "utils.authoring": lambda: importlib.import_module("utils.authoring").main,
    **{
        f"benchmarks/{p.stem}.py": (lambda p=p: _benchmark_main(p.stem))
        for p in sorted((ROOT / "benchmarks").glob("[!_]*.py"))
    },
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_option_has_a_description(tool, monkeypatch):
    parser = _parser_of(TOOLS[tool](), monkeypatch)
    missing = [
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction) and (not a.help or a.help == argparse.SUPPRESS)
    ]
    assert not missing, f"{tool}: options without a --help description: {missing}"


def test_ddp_train_trains_long_enough_from_a_shell():
    from utils.ddp_train import TrainConfig, parse_args

    assert parse_args([]).epochs == 10 and TrainConfig().epochs == 2
