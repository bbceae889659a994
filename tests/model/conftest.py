"""Fixtures shared by the model tests, by the Hugging Face interop tests of every family above all:
the transformers oracle, token ids, random models whose constant-initialized tensors are drawn,
greedy decoding on the transformers side, and the round-trip checks."""

import pytest


@pytest.fixture
def transformers():
    """The transformers package, the oracle: a test without it skips (fails under CI, tests/conftest.py)."""
    return pytest.importorskip("transformers")


@pytest.fixture
def tokens():
    """→ draw(batch=2, length=24, seed=1): token ids (batch, length) below 96, the vocabulary of
    every model these tests build, the same for the same seed."""
    import torch

    def draw(batch: int = 2, length: int = 24, seed: int = 1):
        return torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(seed))

    return draw


@pytest.fixture
def relative_error():
    """→ error(want, got): the largest |want - got| over the largest |want|."""

    def error(want, got) -> float:
        return ((want - got).abs().max() / want.abs().max()).item()

    return error


@pytest.fixture
def randomize():
    """→ draw(model, *, around_zero=(), buffers=()) → model: what a model starts as constants drawn
    at random, so that a misplaced, swapped or missing tensor shows far above any tolerance: norm
    gains from N(1, 0.3), the parameters whose names end in one of `around_zero` (biases, sinks,
    gates) from N(0, 0.5), the buffers whose names end in one of `buffers` (correction biases)
    from N(0, 0.1). The draws come from torch's default generator, in the order of the names."""
    import torch

    def draw(model, *, around_zero: tuple[str, ...] = (), buffers: tuple[str, ...] = ()):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(1.0, 0.3)
                elif name.endswith(around_zero):
                    p.normal_(0.0, 0.5)
            for name, b in model.named_buffers():
                if name.endswith(buffers):
                    b.normal_(0.0, 0.1)
        return model

    return draw


@pytest.fixture
def hf_greedy():
    """→ greedy(hf, prompt, n): the `n` tokens a transformers model appends to `prompt` greedily."""
    import torch

    def greedy(hf, prompt, n: int):
        out = hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones_like(prompt), pad_token_id=0)
        return out[:, prompt.shape[1]:]

    return greedy


@pytest.fixture
def same_tensors():
    """→ check(a, b): the two modules hold the same names and every tensor bit for bit."""
    import torch

    def check(a, b) -> None:
        theirs, ours = a.state_dict(), b.state_dict()
        assert theirs.keys() == ours.keys()
        for name, tensor in theirs.items():
            assert torch.equal(tensor, ours[name]), name

    return check


@pytest.fixture
def fused_layout_logits(tmp_path):
    """→ logits(hf, ids) → (want, got): `hf`'s logits on `ids`, and those of `load_hf` reading a folder
    of `hf`'s state dict written as-is (transformers 5.x modules hold `mlp.experts.gate_up_proj`
    (E, 2F, D)) with its config.json; skips on a transformers whose modules keep per-expert weights,
    where save_pretrained already covers the layout."""
    import torch
    from safetensors.torch import save_file

    from moetron.model.hf import load_hf

    def logits(hf, ids):
        sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if not any(k.endswith("experts.gate_up_proj") for k in sd):
            pytest.skip("this transformers keeps per-expert modules")
        save_file(sd, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text(hf.config.to_json_string())
        with torch.no_grad():
            return hf(ids).logits, load_hf(tmp_path)(ids).logits_BSV

    return logits


@pytest.fixture
def hf_reads_back(tmp_path, transformers, same_tensors):
    """→ check(model, hf, ids, want): `save_hf` of the moetron `model` is read back by transformers
    as `hf`'s class, with every tensor of `hf` and the logits `want` on `ids`, bit for bit."""
    import torch

    from moetron.model.hf import save_hf

    def check(model, hf, ids, want) -> None:
        save_hf(model, tmp_path / "back")
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert type(again) is type(hf)
        same_tensors(hf, again)
        with torch.no_grad():
            assert torch.equal(again(ids).logits, want)

    return check


@pytest.fixture
def hf_round_trip(tmp_path, relative_error, hf_greedy, hf_reads_back):
    """→ check(hf, ids, *, rtol, prompt, new) → the moetron model: `hf` (a transformers model) saved
    with save_pretrained and read by `load_hf` gives logits on `ids` within `rtol` (relative to the
    largest) and the same greedy continuation of `new` tokens from `ids[:, :prompt]`; `save_hf` of it
    is read back by transformers as the same class with every tensor and the logits bit-identical."""
    import torch

    from moetron.model.generate import generate
    from moetron.model.hf import load_hf

    def check(hf, ids, *, rtol: float, prompt: int, new: int):
        hf.save_pretrained(tmp_path / "hf")
        model = load_hf(tmp_path / "hf").eval()
        with torch.no_grad():
            want = hf(ids).logits
            got = model(ids).logits_BSV
        assert relative_error(want, got) < rtol
        start = ids[:, :prompt]
        hf_out = hf_greedy(hf, start, new)
        assert torch.equal(generate(model, start, new), hf_out)
        hf_reads_back(model, hf, ids, want)
        return model

    return check
