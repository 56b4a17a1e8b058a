"""Worker agents: Ray Serve deployments that decode branches and ship their KV."""
