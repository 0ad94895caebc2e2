"""megatron_lrattn: Low-Rank Attention Residuals for Megatron-core decoder pretraining."""

__version__ = "0.1.0"
