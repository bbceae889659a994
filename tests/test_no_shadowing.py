"""Starting Python in the repository, or a script in bench/, must not hide an installed package.

`python -m pytest`, `python -c` and notebooks put the working folder first on sys.path, and
`python bench/x.py` puts bench/ first. The top-level folders are namespace portions (no
`__init__.py`): the import system takes any regular package or module found anywhere on the path
before a namespace portion, so `kernels/` can never stand in for the `kernels` package that
transformers imports. A bench/ script is a plain module, which is taken first wherever it sits,
so its name must not be one that Python or an installed distribution uses.
"""

import importlib.metadata
import json
import re
import subprocess
import sys
from importlib.machinery import PathFinder
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# The repository root is the `moetron` package itself (pyproject's package-dir); `__main__` is
# always the running script, so neither can stand in for anything.
ROOT_FILES = {"__init__.py", "__main__.py"}


def import_names() -> set[str]:
    """Top-level import names of the standard library and of every installed distribution."""
    return set(sys.stdlib_module_names) | set(importlib.metadata.packages_distributions())


def shadowed(folder: Path, names: set[str]) -> dict[str, str]:
    """{name: what in `folder` it resolves to} for each name that Python, started with `folder`
    first on its path, would import from `folder` (the import system's own rule, PathFinder).

    Whatever `folder` holds as a regular module or package is taken before the rest of the path; a
    namespace portion (origin None) is not. Only `folder` itself is searched, so a virtual
    environment inside it (.venv/lib/.../site-packages) is not mistaken for the folder's own files.
    """
    out = {}
    for name in sorted(names):
        spec = PathFinder.find_spec(name, [str(folder)])
        if spec is not None and spec.origin is not None:
            out[name] = spec.origin
    return out


def test_the_check_sees_a_folder_or_module_that_shadows(tmp_path):
    """The check itself: a module named like a stdlib one, and a regular package named like an
    installed distribution, are both reported; a namespace portion is not."""
    (tmp_path / "json.py").write_text("")
    (tmp_path / "yaml").mkdir()
    (tmp_path / "yaml" / "__init__.py").write_text("")
    (tmp_path / "torch").mkdir()  # a namespace portion, as the repository's folders are
    (tmp_path / "torch" / "x.py").write_text("")
    assert set(shadowed(tmp_path, {"json", "yaml", "torch"})) == {"json", "yaml"}


def test_no_top_level_folder_shadows_an_installed_package():
    assert shadowed(ROOT, import_names()) == {}
    portions = [p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert portions == [], f"{portions}: top-level folders must not hold __init__.py (see this module)"
    modules = [p.name for p in ROOT.glob("*.py") if p.name not in ROOT_FILES]
    assert modules == [], f"{modules}: a module at the repository root would shadow any package of that name"


def test_no_bench_module_shadows_an_installed_package():
    assert shadowed(BENCH, import_names()) == {}


def test_transformers_imports_from_the_repository_root():
    pytest.importorskip("transformers")
    code = "import transformers.models.mixtral.modeling_mixtral, transformers.models.bloom.modeling_bloom"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def bench_scripts() -> list[str]:
    """The bench files a user runs: those with a `__main__` entry (the rest, like gloo_ranks.py, are
    helpers the scripts import)."""
    return sorted(p.name for p in BENCH.glob("*.py") if '__name__ == "__main__"' in p.read_text())


def test_every_bench_helper_is_used_by_a_script():
    helpers = {p.stem for p in BENCH.glob("*.py")} - {name[:-3] for name in bench_scripts()}
    sources = "\n".join((BENCH / name).read_text() for name in bench_scripts())
    unused = sorted(h for h in helpers if not re.search(rf"\b(from|import) {h}\b", sources))
    assert unused == [], f"{unused}: bench modules without a `__main__` that no bench script imports"


# One interpreter answers every script's --help in turn (a start costs seconds; the suite has ~20
# scripts), each run as `python bench/NAME.py --help` runs it: as __main__, with bench/ (not the
# repository root) first on sys.path. Prints {script: exit status, or the exception} as JSON.
_EVERY_HELP = """
import contextlib, io, json, runpy, sys
bench, names = sys.argv[1], sys.argv[2:]
sys.path[0] = bench
out = {}
for name in names:
    sys.argv = [f"{bench}/{name}", "--help"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(f"{bench}/{name}", run_name="__main__")
        out[name] = 0
    except SystemExit as e:
        out[name] = e.code or 0
    except BaseException as e:
        out[name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def help_exits() -> dict:
    proc = subprocess.run([sys.executable, "-c", _EVERY_HELP, str(BENCH), *bench_scripts()], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", bench_scripts())
def test_bench_script_starts_as_documented(script, help_exits):
    """`python bench/NAME.py --help` from the repository root: every import at its top resolves."""
    assert help_exits[script] == 0, help_exits[script]
