"""Virtual time: a PS or DDP job in one process, its time from a cost model; the virtual server, its follower
shards and their network, workers, launcher, calibration.
"""
