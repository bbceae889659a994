"""Fixtures shared by the command-line tests."""

import json

import pytest


@pytest.fixture
def cli_json(capsys):
    """→ run(*args) → dict: `moetron ARGS --json` (each arg as str) exits 0 and prints one line of
    JSON on stdout, returned parsed."""
    from moetron.launcher.cli.main import main

    def run(*args) -> dict:
        assert main([*map(str, args), "--json"]) == 0
        out = capsys.readouterr().out
        assert out.count("\n") == 1
        return json.loads(out)

    return run
