"""The parameter server: its core and the core's collaborators, aggregation, staleness, downlink, the TCP
server, the worker's step and protocol.
"""
