"""The serving cluster: wires engines together with Ray Serve, gRPC and Redis."""
