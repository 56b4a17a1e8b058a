"""KV transport between engines: the connector interface (connector.py), chunks, and its implementations."""
