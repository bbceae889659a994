"""Every `moetron` command README.md shows runs as written, from a folder that is not the repository.

Commands are read from the README's fenced code blocks and from its inline code spans. An inline
span is a command when it names a subcommand and then an argument (`moetron train tiny …`), holds
no placeholder (`CONFIG`, `N`, `…`, `a|b`) and parses; a bare mention (`moetron plan`,
`moetron plan --calibrate`) is not. `[optional words]` give two commands: without and with them.
Inline spans made only of `section.key=value` overrides are checked against configs/tiny.yaml.

How each kind is run, in README order, in one temporary folder (so `runs/tiny` from the first
train is there for the generate, eval and export after it):
- `moetron train …`: its config validated as written, then run for real with one step of a narrow
  model appended (`TRAIN_APPENDED`; later overrides win): the step shows the command starts and
  trains; the README's own sizes and step counts take minutes;
- `moetron eval …`: run for real with `--tokens 4096` appended (the default 32,768 tokens per
  length is ~10 s a length on 2 cores);
- `torchrun --nproc-per-node N -m moetron train …`: its config is loaded and validated for N
  launched ranks (the same checks every rank makes before any process group starts); N ranks on
  2 cores take 10–20 s and the layouts themselves are run by tests/parallel;
- `moetron submit …`: the config, allocation and sbatch script are built (what `--dry-run`
  prints), but no partition is asked for, so a Slurm running beside the tests changes nothing;
- anything else: run for real as written.
"""

import contextlib
import io
import re
import shlex
from pathlib import Path

from moetron.launcher.cli.main import build_parser, main
from moetron.launcher.config import ConfigError, load_config, validate_launch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Appended to a README train command once it has validated as written: one step of a narrow model.
TRAIN_APPENDED = ["train.steps=1", "train.batch_size=4", "train.seq_len=64", "train.eval_batches=1",
                  "model.d_model=64", "model.n_layers=2", "model.d_ff=128", "model.moe.d_expert=64"]
EVAL_APPENDED = ["--tokens", "4096"]
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*(\.\.\.)?|.*(…|\.\.\.|\|).*")
OVERRIDE = re.compile(r"[a-z_]+(\.[a-z_0-9]+)+=\S+")


def fenced_commands(text: str) -> list[str]:
    lines = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.DOTALL):
        lines += [line.strip() for line in block.splitlines()]
    return [line for line in lines if re.match(r"(moetron|python -m moetron|torchrun)\s", line)]


def inline_spans(text: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]


def expand_optional(command: str) -> list[str]:
    """'a [b c]' → ['a', 'a b c']."""
    match = re.search(r"\[([^\]]*)\]", command)
    if not match:
        return [command]
    without = command[:match.start()] + command[match.end():]
    with_ = command[:match.start()] + match.group(1) + command[match.end():]
    return expand_optional(" ".join(without.split())) + expand_optional(" ".join(with_.split()))


def moetron_argv(words: list[str]) -> tuple[list[str], int | None]:
    """(the arguments after `moetron`, the ranks torchrun would launch or None)."""
    if words[0] == "moetron":
        return words[1:], None
    if words[:3] == ["python", "-m", "moetron"]:
        return words[3:], None
    assert words[0] == "torchrun", words
    at = words.index("-m")
    assert words[at + 1] == "moetron", words
    opts = words[1:at]
    ranks = int(opts[opts.index("--nproc-per-node") + 1])
    return words[at + 2:], ranks


def parses(argv: list[str]) -> bool:
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage text for a mere mention
            build_parser().parse_known_args(argv)
    except SystemExit:
        return False
    return True


def readme_commands() -> list[tuple[list[str], int | None]]:
    """Every runnable command of README.md in order: (argv after `moetron`, torchrun's ranks)."""
    text = README.read_text()
    out = []
    for line in fenced_commands(text):
        words = shlex.split(line, comments=True)
        out.append(moetron_argv(words))
    for span in inline_spans(text):
        if not re.match(r"(moetron|python -m moetron|torchrun)\s", span) or span in fenced_commands(text):
            continue
        for command in expand_optional(span):
            words = shlex.split(command)
            if any(PLACEHOLDER.fullmatch(w) for w in words):
                continue
            argv, ranks = moetron_argv(words)
            if len(argv) < 2 or argv[1].startswith("-") or not parses(argv):
                continue  # a mention of a command or a flag, not a command to run
            out.append((argv, ranks))
    return out


def run_one(argv: list[str], ranks: int | None, tmp_path: Path) -> int:
    command = argv[0]
    if ranks is not None:
        assert command == "train", f"only torchrun train commands are known here: {argv}"
        args, extra = build_parser().parse_known_args(argv)
        cfg = load_config(args.config, [*args.overrides, *extra], world_size=ranks)
        validate_launch(cfg, ranks)
        return 0
    if command == "submit":
        from moetron.launcher.cli.submit import config_and_allocation
        from moetron.launcher.cluster.submit import build_submission

        cfg, slurm_cfg = config_and_allocation(build_parser().parse_args(argv))
        assert "srun" in build_submission(cfg, slurm_cfg, cwd=tmp_path).script
        return 0
    if command == "train":
        args, extra = build_parser().parse_known_args(argv)
        load_config(args.config, [*args.overrides, *extra])  # as written, before anything is appended
        return main([*argv, *TRAIN_APPENDED])
    if command == "eval":
        return main([*argv, *EVAL_APPENDED])
    return main(argv)


def test_the_readme_shows_runnable_commands():
    """The reader above finds what a first session needs, so the test below cannot pass empty."""
    found = [" ".join(argv) for argv, _ in readme_commands()]
    for needle in ("train tiny model.moe.top_k=1", "generate runs/tiny", "eval runs/tiny", "export runs/tiny",
                   "flops tiny", "plan tiny", "submit configs/mixtral-8x7b.yaml", "train configs/tiny.yaml parallel.tp=2"):
        assert any(c.startswith(needle) for c in found), (needle, found)
    assert sum(ranks is not None for _, ranks in readme_commands()) >= 3  # both forms of the optional groups
    assert not any(PLACEHOLDER.fullmatch(w) for argv, _ in readme_commands() for w in argv)


def test_every_readme_command_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # not the repository: presets must resolve from the package
    failed = []
    for argv, ranks in readme_commands():
        try:
            status = run_one(argv, ranks, tmp_path)
        except SystemExit as e:  # argparse refusing the command line
            status = e.code
        except ConfigError as e:  # a README config refused while validated as written
            status = f"{type(e).__name__}: {e}"
        err = capsys.readouterr().err
        if status != 0:
            failed.append(f"{'torchrun ' if ranks else ''}moetron {shlex.join(argv)} → exit {status}: {err.strip()}")
    assert not failed, "\n".join(failed)


def test_readme_override_examples_are_valid_on_the_default_config():
    overrides = [span.split() for span in inline_spans(README.read_text())
                 if all(OVERRIDE.fullmatch(w) for w in span.split())]
    assert overrides  # e.g. `model.rope_scaling=yarn`
    for example in overrides:
        load_config("tiny", example)
