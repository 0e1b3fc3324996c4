"""Tensor parallelism: one model over a mesh of devices, with JAX's named shardings.

mesh.py builds the mesh (axes ("data", "model"), AxisType.Auto) and describes it; layout.py decides
which heads and columns each shard holds (and refuses sizes that do not divide); sharding.py gives
every parameter and the KV arena its PartitionSpec and places host arrays shard by shard;
attention.py runs a layer's KV write and paged attention per shard inside `jax.shard_map`;
distributed.py joins several hosts into one mesh through `jax.distributed`; collectives.py reads
the collectives out of a compiled step and report.py measures bytes and collectives per device.
docs/design.md, "Tensor parallelism and multi-host", is the narrative.
"""
