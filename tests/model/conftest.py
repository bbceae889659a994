"""Fixtures shared by the Hugging Face interop tests of every family."""

import pytest


@pytest.fixture
def fused_hf_folder(tmp_path):
    """→ save(hf): a folder holding `hf`'s state dict written as-is (transformers 5.x modules hold
    `mlp.experts.gate_up_proj` (E, 2F, D)) with its config.json; skips on a transformers whose
    modules keep per-expert weights, where save_pretrained already covers the layout."""
    from safetensors.torch import save_file

    def save(hf):
        sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if not any(k.endswith("experts.gate_up_proj") for k in sd):
            pytest.skip("this transformers keeps per-expert modules")
        save_file(sd, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text(hf.config.to_json_string())
        return tmp_path

    return save


@pytest.fixture
def hf_round_trip(tmp_path):
    """→ check(hf, ids, *, rtol, prompt, new) → the moetron model: `hf` (a transformers model) saved
    with save_pretrained and read by `load_hf` gives logits on `ids` within `rtol` (relative to the
    largest) and the same greedy continuation of `new` tokens from `ids[:, :prompt]`; `save_hf` of it
    is read back by transformers as the same class with every tensor and the logits bit-identical."""
    import torch
    import transformers

    from moetron.model.generate import generate
    from moetron.model.hf import load_hf, save_hf

    def check(hf, ids, *, rtol: float, prompt: int, new: int):
        hf.save_pretrained(tmp_path / "hf")
        model = load_hf(tmp_path / "hf").eval()
        with torch.no_grad():
            want = hf(ids).logits
            got = model(ids).logits_BSV
        assert ((want - got).abs().max() / want.abs().max()).item() < rtol
        start = ids[:, :prompt]
        hf_out = hf.generate(start, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             attention_mask=torch.ones_like(start), pad_token_id=0)[:, prompt:]
        assert torch.equal(generate(model, start, new), hf_out)

        save_hf(model, tmp_path / "back")
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert type(again) is type(hf)
        theirs, ours = hf.state_dict(), again.state_dict()
        assert theirs.keys() == ours.keys()
        for name, tensor in theirs.items():
            assert torch.equal(tensor, ours[name]), name
        with torch.no_grad():
            assert torch.equal(again(ids).logits, want)
        return model

    return check
