"""The depth mechanism: schedule of read sites, the per-microbatch source state with its wire
format, pipeline stage shapes, the rank-local stage cache and the per-hop payload report.
Depends on ``megatron_lrattn.ops`` only."""
