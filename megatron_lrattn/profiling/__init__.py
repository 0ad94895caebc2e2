"""Throughput profiling of the residual modes side by side (``lrattn-profile``)."""
