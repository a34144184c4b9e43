"""What every server shard serves and the rules it applies: the served model (its layout, decoding, sources),
aggregation (versions, the sync round, de-dup), staleness, the downlink and replies, a streamed push's parts and the
slice pipeline. The server core (:mod:`src.ps.server`) and the follower core (:mod:`src.ps.shards`) build on them."""
