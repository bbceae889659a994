"""The single-device model: plain PyTorch, no torch.distributed. Parallelism is applied from outside."""

from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.transformer import Decoder, ModelOutput, build_model

__all__ = ["Decoder", "ModelConfig", "ModelOutput", "MoEConfig", "build_model"]
