"""constraints.txt, which `make test` and CI install with, pins every dependency pyproject.toml
declares (core, dev and oracles) to a version inside the declared range."""

from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            out[canonicalize_name(name)] = version
    return out


def test_every_declared_dependency_is_pinned_inside_its_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    pinned = pins()
    env = default_environment()
    checked = 0
    for line in declared:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        if name == canonicalize_name(project["name"]):
            continue  # one extra naming another ("moetron[data]"): its requirements are checked there
        assert name in pinned, f"{req.name} is declared in pyproject.toml but not pinned in constraints.txt"
        assert req.specifier.contains(pinned[name], prereleases=True), \
            f"constraints.txt pins {req.name}=={pinned[name]}, outside pyproject.toml's {req.specifier}"
        checked += 1
    assert checked >= 10

