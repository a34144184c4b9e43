"""A parameter server split across shards: where each tensor lives (placement, each shard's part), sync rounds and
their signed certificates, async per shard, what a follower knows of the workers, recovery, the final whole model, and
the follower's core and driver. Shard 0 is the server core with its :class:`~src.ps.shards.shard_zero.Sharding`."""
