"""`moetron plan` searches each parallel section's variants by bisection on gradient accumulation
instead of estimating the memory of every one: the same plan as the exhaustive search (written
out here), with a logarithmic number of memory estimates per section."""

import dataclasses
import math

import pytest

from moetron.launcher.config import load_config
from moetron.launcher.perf import planner
from moetron.launcher.perf.device_profiles import get_profile


def exhaustive_plan(cfg, gpus, profile, *, gpus_per_node):
    """Every variant of every section: (label, step_s, memory) of the fastest that fits, per section."""
    budget = planner.MEMORY_HEADROOM * profile.memory_bytes
    best = {}
    for par in planner.base_layouts(cfg, gpus, gpus_per_node=gpus_per_node):
        layouts = planner.variants(cfg, par)
        if not layouts or not planner.is_valid(planner.layout_config(cfg, layouts[0]), gpus):
            continue
        preds = [planner.predict(planner.layout_config(cfg, layout), layout, profile, gpus_per_node=gpus_per_node)
                 for layout in layouts if planner.is_valid(planner.layout_config(cfg, layout), gpus)]
        fitting = [p for p in preds if p.memory["total"] <= budget]
        if fitting:
            p = min(fitting, key=lambda p: (p.step_s, p.memory["total"]))
            best[par] = (p.layout.label(), p.step_s, p.memory["total"])
    return best


@pytest.fixture(scope="module")
def tight():
    """The tiny MoE on 8 devices with so little memory that most sections fit only with
    accumulation or checkpointing, and some not at all."""
    cfg = load_config("tiny", ["train.grad_accum=1", "train.batch_size=64"], world_size=8)
    profile = dataclasses.replace(get_profile("H100"), memory_bytes=0.09 * 2**30)
    return cfg, profile


def test_the_plan_equals_the_exhaustive_search(tight):
    cfg, profile = tight
    result = planner.plan(cfg, 8, profile, gpus_per_node=8)
    want = exhaustive_plan(cfg, 8, profile, gpus_per_node=8)
    got = {p.layout.parallel: (p.layout.label(), p.step_s, p.memory["total"]) for p in result.ranked}
    assert got == want
    assert result.dropped and len({p.layout.grad_accum for p in result.ranked}) > 1  # memory binds here
    assert any(p.layout.activation_checkpoint != "none" for p in result.ranked)


def test_memory_is_estimated_a_logarithmic_number_of_times(tight, monkeypatch):
    """Per section and checkpointing choice of n accumulations, at most ceil(log2(n + 1)) memory
    estimates search for the first that fits (those `predict` makes for its own report aside);
    trying each in turn made up to n."""
    cfg, profile = tight
    probes, inside = {}, []
    real_memory, real_predict = planner.predict_memory, planner.predict

    def counted_memory(full, layout, **kw):
        if not inside:
            key = (layout.parallel, layout.activation_checkpoint)
            probes[key] = probes.get(key, 0) + 1
        return real_memory(full, layout, **kw)

    def flagged_predict(*a, **kw):
        inside.append(1)
        try:
            return real_predict(*a, **kw)
        finally:
            inside.pop()

    monkeypatch.setattr(planner, "predict_memory", counted_memory)
    monkeypatch.setattr(planner, "predict", flagged_predict)
    planner.plan(cfg, 8, profile, gpus_per_node=8)
    sizes = {}
    for par, ac in probes:
        sizes[par, ac] = sum(v.activation_checkpoint == ac for v in planner.variants(cfg, par))
    over = {k: (n, sizes[k]) for k, n in probes.items() if n > math.ceil(math.log2(sizes[k] + 1))}
    assert not over, over
    assert max(sizes.values()) >= 7 and max(probes.values()) >= 3  # long enough for the bound to bite
