"""Test-wide setup.

Triton's interpreter must be chosen before anything imports triton (see the kernel tests), so it is
set here, at collection, whenever no CUDA device is present.

Oracle tests compare moetron with an independent implementation from the optional [oracles] extra
and reach it through `pytest.importorskip`: on a developer's machine without the extra they skip.
Under CI (`CI=true`, which the CI runner sets) such a skip fails the test instead, naming the
package, so that a broken install cannot turn the references off while the run stays green.
"""

import fcntl
import gc
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# Top-level packages of the [oracles] extra (pyproject.toml), and of the [data] and [fp8] extras the dev
# extra pulls in (`moetron data prepare`'s parquet and `datasets` readers): `make setup-test` installs all.
ORACLES = ("deepspeed", "megatron", "transformers", "pyarrow", "datasets", "torchao")
# pytest.importorskip's own reasons: "could not import 'a.b': …" and "module 'a.b' has __version__ …".
_IMPORTORSKIP = re.compile(r"(?:could not import|module) '([\w.]+)'")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch missing means no CUDA either
        return False


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config) -> None:
    """Under pytest-xdist each worker takes its share of the cores for torch's intra-op threads,
    and so do the processes it starts that do not set their own: `make test`'s two workers on two
    cores otherwise run two OpenMP threads each, whose spin-waits take the CPU the other worker
    needs (tests/model and tests/kernels: 111–130 s with torch's default, 92 s with one thread).

    Inductor's compile workers likewise: each compiling process would start a pool of as many
    workers as the machine has cores, each importing torch, to compile C++ kernels beside the
    other worker's tests (the compiled parity test: 457 CPU-s with a pool per rank, 414 without)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _missing_oracle(reason: str) -> str | None:
    """The oracle package an importorskip `reason` names, or None for any other skip."""
    found = _IMPORTORSKIP.search(reason)
    top = found.group(1).split(".")[0] if found else None
    return top if top in ORACLES else None


def _fail_instead(report, reason: str) -> None:
    """Turn a skipped `report` into a failure when it skipped for a missing oracle under CI."""
    package = _missing_oracle(reason)
    if package is None or not _under_ci():
        return
    report.outcome = "failed"
    report.longrepr = (f"oracle package {package!r} is missing under CI=true ({reason.removeprefix('Skipped: ')}); "
                       f"oracle tests may not skip in CI: install the [oracles] and [dev] extras (make setup-test)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and call.excinfo is not None and call.excinfo.errisinstance(pytest.skip.Exception):
        _fail_instead(report, str(call.excinfo.value))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module-level importorskip skips the whole file at collection."""
    report = yield
    if report.skipped and isinstance(report.longrepr, tuple):
        _fail_instead(report, str(report.longrepr[2]))
    return report


@pytest.hookimpl(tryfirst=True)  # before pytest-forked forks the test's process
def pytest_runtest_protocol(item, nextitem):
    """Collect the worker's garbage before a forked test forks: an earlier test's gloo process
    group, unreachable but not yet collected, must be destroyed here, where its threads run. In the
    child, where they do not, its destructor waits for them forever (a hang seen once)."""
    if item.get_closest_marker("forked") is not None:
        gc.collect()


@pytest.fixture(autouse=True)
def _one_thread_in_forked_tests(request):
    """A forked child inherits the parent's OpenMP thread pool but not its threads: once the
    parent has run a parallel torch op, the child's first one waits forever at a barrier. The
    child therefore runs torch single-threaded (the interpreter is the bottleneck anyway)."""
    if request.node.get_closest_marker("forked") is not None:
        import torch

        torch.set_num_threads(1)


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size_bytes) → a fresh tmpfs of that size, or None where this process may not mount
    one (tmpfs needs root). Each is unmounted afterwards, and a plain umount fails while a file
    on it is still open: that is a leak in the code under test."""
    mounted = []

    def mount(size: int):
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                                               capture_output=True).returncode != 0:
            return None
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        assert subprocess.run(["umount", str(where)], capture_output=True).returncode == 0, f"a file on {where} is left open"


@pytest.fixture
def slurm_ports():
    """The first port of a block of five (slurmctld, slurmd, slurmdbd, MariaDB, a first extra node)
    that no other test holds and nothing listens on, for a local Slurm of the test's own
    (MOETRON_SLURM_PORT). A lock file per block holds it until the test ends: two xdist workers that
    scan at once would otherwise both find a block free before either's MariaDB binds it."""
    for base in range(7917, 8900, 10):
        lock = open(f"/tmp/moetron-slurm-ports-{base}.lock", "w")  # noqa: SIM115 - held until teardown
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            for port in range(base, base + 5):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            lock.close()
            continue
        yield base
        lock.close()  # closing releases the lock
        return
    pytest.skip("no block of five free ports in 7917..8900 for a local Slurm")


@pytest.fixture(scope="session")
def forked_ranks():
    """launch(request) → answer: the ranks of one launch forked from a process of this pytest worker
    that imported the training stack once (tests/forked_ranks.py, whose docstring has the request
    and the answer), instead of torchrun's interpreter and imports per rank and launch."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forked_ranks.py"))], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def launch(request: dict) -> dict:
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        answer = proc.stdout.readline()
        if not answer:
            pytest.fail(f"the rank forker ended (exit {proc.poll()}) before answering {request}")
        return json.loads(answer)

    yield launch
    proc.kill()
    proc.wait()


@pytest.fixture(scope="session")
def forked_script(forked_ranks):
    """run(script, ranks, args, timeout) → the JSON lines rank 0 of `python script args...` printed,
    its ranks forked (forked_ranks), run from the repository's root; fails the test when a rank
    failed before rank 0 printed any."""
    root = Path(__file__).resolve().parents[1]

    def run(script: Path, ranks: int, args: list[str], timeout: float) -> list[dict]:
        answer = forked_ranks({"ranks": ranks, "script": str(script), "args": args, "cwd": str(root),
                               "tail": 1 << 20, "timeout": timeout})
        lines = [json.loads(line) for line in answer["output"]["0"].splitlines() if line.startswith("{")]
        if answer["codes"] != [0] * ranks and not lines:
            pytest.fail(f"{script.name} {' '.join(args)[:200]} on {ranks} ranks failed:\n"
                        f"{json.dumps(answer['output'], indent=1)[-3000:]}")
        return lines

    return run


@pytest.fixture(scope="session")
def forked_moetron(forked_ranks):
    """run(ranks, argv, env=None, timeout=600) → `moetron *argv` as a CompletedProcess, on `ranks`
    ranks forked as torchrun starts them (one rank: as `python -m moetron` runs, without torchrun's
    variables; forked_ranks), run from the repository's root with `env` added to the environment:
    the first failed rank's exit status, rank 0's stdout, and the stderr of rank 0 and of every rank
    that failed."""
    root = Path(__file__).resolve().parents[1]

    def run(ranks: int, argv: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        answer = forked_ranks({"ranks": ranks, "argv": argv, "cwd": str(root), "torchrun": ranks > 1, "env": env or {},
                               "stderr": True, "tail": 1 << 20, "timeout": timeout})
        code = next((c for c in answer["codes"] if c), 0)
        return subprocess.CompletedProcess(argv, code, answer["output"]["0"], "".join(answer["stderr"].values()))

    return run


@pytest.fixture
def tmp_run_dir(tmp_path):
    """A fresh folder for run outputs (metrics, checkpoints, TensorBoard)."""
    d = tmp_path / "runs"
    d.mkdir()
    return d


@pytest.fixture
def triton_target():
    """(backend, device) for the Triton kernels: compiled on a GPU, interpreted on CPU."""
    import importlib.util

    import torch

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        return "triton", torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set (tests/conftest.py sets it)")
    return "interpret", torch.device("cpu")


@pytest.fixture(scope="session")
def bench_script():
    """load(name) → bench/NAME.py imported as a module, so a test calls the script's own functions
    (bench/ holds scripts, not a package)."""
    import importlib.util

    folder = Path(__file__).resolve().parents[1] / "bench"

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"{name}_bench", folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.hookimpl(trylast=True)  # after tests/slurm/conftest.py has put its tests in one group
def pytest_collection_modifyitems(items) -> None:
    """Start the long work first: the Slurm group (one unit on one worker, mostly waiting on the
    scheduler's clock), then `slow`, then `distributed` tests (collection order within each), so the
    two workers of `make test` end on short tests together instead of one waiting on a long one
    that was collected last."""

    def rank(item) -> int:
        group = item.get_closest_marker("xdist_group")
        if group is not None and group.args and group.args[0] == "slurm":
            return 0
        return 1 if item.get_closest_marker("slow") else 2 if item.get_closest_marker("distributed") else 3

    items.sort(key=rank)
