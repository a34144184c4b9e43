"""The parameter server, by side: ``state/`` (the served model and the update rules every shard applies), ``shards/``
(placement, rounds and certificates, async per shard, recovery, the follower core), ``server/`` (the server core and
its collaborators) and ``worker/`` (the step machine every worker carries). The server transports are in
``src/transport/``."""
