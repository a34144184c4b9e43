"""The parameter server's wire: message bytes, TCP frames, the gRPC and TCP clients, health probes, protobuf stubs."""
