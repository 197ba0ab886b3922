"""The paraminit contract: generated protobuf and gRPC code for paraminit.v1."""
