"""The gRPC surface: server lifecycle, the servicer, the status boundary, authentication, metrics."""
