"""What the deployments share: typed messages between them, the Redis directory and sessions, metrics, async helpers."""
