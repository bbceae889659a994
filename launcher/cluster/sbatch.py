"""Render the batch script template in `slurm/moetron.sbatch` into a script `sbatch` accepts.

The template is plain bash with `{{ field }}` placeholders. A line whose placeholder is unset
(None) or False is left out, so optional directives vanish instead of reaching sbatch empty;
True renders as nothing, which makes `--exclusive{{ exclusive }}` a flag. `{{ ... }}` keeps
bash's own `$VAR` and `${VAR}` untouched, unlike string.Template.

    script = render_sbatch({"job_name": "tiny", "nodes": 2, "tasks_per_node": 8,
                            "gpus_per_node": 8, "command": ["python", "-m", "moetron", "train", "x.yaml"]})
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any, Optional

_PLACEHOLDER = re.compile(r"\{\{\s*([a-z_]+)\s*\}\}")

# Every field the template knows. Required ones have no default; the others are optional
# directives (None leaves the line out) or have the default shown.
FIELDS: dict[str, Any] = {
    "job_name": ...,
    "command": ...,
    "nodes": 1,
    # With nodes, the range MIN-MAX: Slurm starts the job on as many nodes as are up, at least this
    # many, and when one fails the script starts the ranks again on the others (slurm/moetron.sbatch).
    "min_nodes": None,
    "tasks_per_node": 1,
    "gpus_per_node": None,
    "cpus_per_task": None,
    "partition": None,
    "time": None,
    "account": None,
    "qos": None,
    "constraint": None,
    "exclusive": False,
    "requeue": None,  # default: True when requeue_limit > 0, since `scontrol requeue` needs it
    "no_kill": None,  # default: True with min_nodes: a failed node leaves the job the others
    "requeue_limit": 0,
    "signal_seconds": None,
    "output": "%x-%j.out",
    # Where the tasks start; default: the folder sbatch was run from.
    "chdir": None,
}

# Values that reach sbatch as numbers must be positive (or zero where that means "none").
_MIN = {"nodes": 1, "min_nodes": 1, "tasks_per_node": 1, "gpus_per_node": 0, "cpus_per_task": 1, "requeue_limit": 0,
        "signal_seconds": 1}
_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^(UNLIMITED|INFINITE)$")


class SbatchError(ValueError):
    """A field of the batch script is missing, unknown or has an unusable value."""


def template_text() -> str:
    """The packaged template, `slurm/moetron.sbatch`."""
    return (resources.files("moetron.slurm") / "moetron.sbatch").read_text()


def render_sbatch(values: Mapping[str, Any], template: Optional[str] = None) -> str:
    """Fill the template (default: the packaged one) from `values`; see FIELDS for the names."""
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise SbatchError(f"unknown sbatch field(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    filled = {name: values.get(name, default) for name, default in FIELDS.items()}
    missing = [name for name, value in filled.items() if value is ... or (FIELDS[name] is ... and value is None)]
    if missing:
        raise SbatchError(f"sbatch field(s) {', '.join(missing)} must be set")
    if filled["requeue"] is None:
        filled["requeue"] = filled["requeue_limit"] > 0
    if filled["no_kill"] is None:
        filled["no_kill"] = filled["min_nodes"] is not None
    _check(filled)
    if filled["min_nodes"] is not None:
        filled["nodes"] = f"{filled['min_nodes']}-{filled['nodes']}"
    return render(template if template is not None else template_text(), filled)


def render(template: str, values: Mapping[str, Any]) -> str:
    """Substitute `{{ name }}` in `template`, dropping every line that refers to an unset value.

    Generic: knows nothing of sbatch. A name absent from `values` is an error, so a typo in the
    template cannot silently drop a directive."""
    lines = []
    for number, line in enumerate(template.splitlines(keepends=True), start=1):
        names = _PLACEHOLDER.findall(line)
        absent = [name for name in names if name not in values]
        if absent:
            raise SbatchError(f"template line {number} uses {{{{ {absent[0]} }}}}, which has no value")
        if any(values[name] is None or values[name] is False for name in names):
            continue
        lines.append(_PLACEHOLDER.sub(lambda m: _text(m.group(1), values[m.group(1)]), line))
    return "".join(lines)


def _text(name: str, value: Any) -> str:
    if value is True:
        return ""
    if isinstance(value, (list, tuple)):
        return shlex.join(str(v) for v in value)
    text = str(value)
    # A newline would start a new shell line or directive of the caller's making.
    if "\n" in text or "\r" in text:
        raise SbatchError(f"sbatch field {name}={text!r} must be a single line")
    return text


def _check(values: Mapping[str, Any]) -> None:
    for name, low in _MIN.items():
        value = values[name]
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise SbatchError(f"sbatch field {name}={value!r} must be an integer >= {low}")
        if value < low:
            raise SbatchError(f"sbatch field {name}={value} must be >= {low}")
    if values["min_nodes"] is not None and values["min_nodes"] > values["nodes"]:
        raise SbatchError(f"sbatch field min_nodes={values['min_nodes']} must be at most nodes={values['nodes']}")
    for name in ("exclusive", "requeue", "no_kill"):
        if not isinstance(values[name], bool):
            raise SbatchError(f"sbatch field {name}={values[name]!r} must be true or false")
    time = values["time"]
    if time is not None and not _SLURM_TIME.match(str(time)):
        raise SbatchError(
            f"sbatch field time={time!r} is not a Slurm time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
        )
    for name in ("job_name", "partition", "account", "qos", "constraint", "output", "chdir"):
        value = values[name]
        if value is not None and (not isinstance(value, str) or not value or any(c.isspace() for c in value)):
            raise SbatchError(f"sbatch field {name}={value!r} must be a non-empty string without spaces")
    command = values["command"]
    if isinstance(command, str):
        if not command.strip():
            raise SbatchError("sbatch field command is empty; give the program to run on every task")
    elif not isinstance(command, Sequence) or not command:
        raise SbatchError(f"sbatch field command={command!r} must be a non-empty list of arguments or a shell string")

