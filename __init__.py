"""moetron: train sparse Mixture-of-Experts decoder language models at scale."""

__version__ = "0.1.0"
