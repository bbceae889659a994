"""Put on PYTHONPATH, every optimizer step of the process is followed by a pause of
MOETRON_TEST_STEP_PAUSE seconds, in a Slurm job's first attempt only: a job that must outlast one of
Slurm's 30-s looks lasts as long as its steps times the pause, on any machine, and leaves the CPU to
the other tests while it waits; once requeued it runs its remaining steps unpaused.

The pause is a global optimizer-step hook of torch (it changes no number the step computes),
registered when torch.optim.optimizer is first imported, so a process that never imports torch
never imports it here. It replaces the interpreter's own sitecustomize (Debian's only installs
apport's exception hook).
"""

import importlib.abc
import importlib.util
import os
import sys
import time


class _PauseAfterOptimizerSteps(importlib.abc.MetaPathFinder):
    def __init__(self, seconds: float):
        self.seconds = seconds

    def find_spec(self, name, path=None, target=None):
        if name != "torch.optim.optimizer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.register_optimizer_step_post_hook(lambda *_: time.sleep(self.seconds))

        spec.loader.exec_module = exec_module
        return spec


# A requeued attempt (Slurm counts the restarts) needs only to finish: pausing it would keep the
# test waiting on steps that test nothing.
if os.environ.get("MOETRON_TEST_STEP_PAUSE") and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
    sys.meta_path.insert(0, _PauseAfterOptimizerSteps(float(os.environ["MOETRON_TEST_STEP_PAUSE"])))
