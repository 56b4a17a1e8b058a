"""Load tests for the gRPC agent API: arrivals, a workflow mix, and vLLM's serving metrics."""
