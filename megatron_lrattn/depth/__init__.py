"""The depth mechanism: schedule of read sites, the per-microbatch source state, its pipeline
wire format and the rank-local stage cache. Depends on ``megatron_lrattn.ops`` only."""
