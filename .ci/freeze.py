"""Print the exact versions of everything `make test` installs, for constraints.txt.

Walks the installed requirement tree from moetron with its `dev` and `oracles` extras (DeepSpeed,
transformers and megatron-core among them), so the file pins what the suite ran with and nothing
else that happens to be on the machine. Local version labels are dropped (`torch==2.13.0`, not
`2.13.0+cpu`), so the pin admits the CPU build here and a CUDA build elsewhere.

    python .ci/freeze.py > constraints.txt      # after `make test-latest` passed
"""

from __future__ import annotations

import importlib.metadata as md
import sys

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def closure(root: str, extras: set[str]) -> dict[str, str]:
    """{canonical name: installed version} of `root` and every requirement it pulls in."""
    env = default_environment()
    found: dict[str, str] = {}
    todo = [(root, frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional requirement not installed here
        key = canonicalize_name(dist.metadata["Name"])
        if key in found and not wanted:
            continue
        found[key] = dist.version
        for line in dist.requires or ():
            req = Requirement(line)
            marker_ok = req.marker is None or any(
                req.marker.evaluate({**env, "extra": extra}) for extra in (wanted or {""}))
            if marker_ok:
                todo.append((req.name, frozenset(req.extras)))
    return found


def main() -> None:
    pins = closure("moetron", {"dev", "oracles"})
    pins.pop("moetron", None)
    print("# Versions `make test` last passed with; written by .ci/freeze.py (see README, Tests).")
    print(f"# Python {sys.version.split()[0]}")
    for name in sorted(pins):
        print(f"{name}=={Version(pins[name]).public}")


if __name__ == "__main__":
    main()
