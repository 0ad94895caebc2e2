"""Analyses of a model configuration or a trained model (FLOP and parameter accounting)."""
