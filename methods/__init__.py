"""The multi-agent methods built on the core's public API: Parallel-Synthesis and its calibration, Staircase Streaming,
KVComm, and agent DAGs (Prompt Choreography)."""
