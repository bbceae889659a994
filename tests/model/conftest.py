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
