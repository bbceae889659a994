"""The floors and rooms of docs/architecture.md, kept: imports go kernels → model → parallel →
launcher and, inside launcher/, down the rooms' floors; launcher/ keeps its rooms and at most four
loose modules; no function in launcher/, model/ or parallel/ is longer than 60 lines.

Walks the source with `ast`, so the rules hold for lazy imports inside functions too.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ["kernels", "model", "parallel", "launcher"]
# What each folder may import from moetron.
ALLOWED = {
    "kernels": {"kernels"},
    "model": {"model", "kernels"},
    "parallel": {"parallel", "model", "kernels"},
    "launcher": {"launcher", "parallel", "model", "kernels", "slurm", "configs"},
}


def imports_of(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import; use moetron.<folder> absolute imports")
    return names


@pytest.mark.parametrize("folder", FOLDERS)
def test_imports_go_one_way(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    for path in files:
        for name in imports_of(path):
            parts = name.split(".")
            if parts[0] == "moetron" and len(parts) > 1 and parts[1] not in ("__version__",):
                assert parts[1] in ALLOWED[folder], f"{path.relative_to(ROOT)} imports {name}"
            if folder in ("model", "kernels"):
                assert not name.startswith("torch.distributed"), f"{path.relative_to(ROOT)} imports {name}"
            for other in ("model", "kernels", "parallel", "launcher"):
                # the bare folder names collide with other packages; always go through moetron.
                assert parts[0] != other, f"{path.relative_to(ROOT)} imports {name}; use moetron.{name}"


# What each room of launcher/ may import from launcher/ (docs/architecture.md).
ROOMS = {
    "config": set(),
    "data": {"config"},
    "perf": {"config"},
    "checkpoint": {"config", "data"},
    "run_dir": {"config", "checkpoint"},
    "cluster": {"config", "run_dir", "checkpoint"},
    "train": {"config", "data", "perf", "checkpoint", "run_dir", "cluster"},
    "cli": {"config", "data", "perf", "checkpoint", "run_dir", "cluster", "train"},
}
MAX_LOOSE_MODULES = 4
MAX_FUNCTION_LINES = 60


def room_of(path: Path) -> str:
    """launcher/train/trainer.py → "train"; launcher/config.py → "config"."""
    rel = path.relative_to(ROOT / "launcher")
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_launcher_is_cut_into_its_rooms():
    loose = sorted(p.stem for p in (ROOT / "launcher").glob("*.py") if p.stem != "__init__")
    assert len(loose) <= MAX_LOOSE_MODULES, f"launcher/ has {len(loose)} loose modules: {loose}"
    found = {room_of(p) for p in (ROOT / "launcher").rglob("*.py") if p.stem != "__init__"}
    assert found == set(ROOMS), f"rooms on disk {sorted(found)} vs docs/architecture.md {sorted(ROOMS)}"


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_launcher_rooms_import_down(room):
    for path in sorted((ROOT / "launcher").rglob("*.py")):
        if room_of(path) != room:
            continue
        for name in imports_of(path):
            parts = name.split(".")
            if parts[:2] == ["moetron", "launcher"] and len(parts) > 2 and parts[2] != room:
                assert parts[2] in ROOMS[room], f"{path.relative_to(ROOT)} imports {name}"


def test_functions_fit_one_screen():
    long = []
    for folder in ("launcher", "model", "parallel"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "longer than one screen: " + "; ".join(long)


def test_no_work_at_import_time(tmp_path):
    """Importing every module must not start threads, read data or import triton."""
    import subprocess
    import sys

    code = ("import sys, threading\n"
            "import moetron.model, moetron.kernels, moetron.parallel, moetron.launcher.cli.main\n"
            "assert threading.active_count() == 1, threading.enumerate()\n"
            "assert 'triton' not in sys.modules, 'triton imported at import time'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_quick_commands_do_not_load_torch(tmp_path):
    """`moetron --help` and the Slurm queries answer at once: nothing on their path imports torch."""
    import subprocess
    import sys

    code = ("import sys\nfrom moetron.launcher.cli.main import build_parser\nbuild_parser()\n"
            "assert 'torch' not in sys.modules, 'torch imported by the CLI parser'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
