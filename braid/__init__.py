"""Braid: a serving cluster for multi-agent LLM workflows that ships KV caches instead of text.

One import namespace over the design's top-level folders (see pyproject.toml):
braid.engine (model math), braid.kernels, braid.protos, braid.kv (KV connector),
braid.api (the agent API and its control plane), braid.workers and braid.synthesizer
(the deployments), braid.cluster (Serve wiring), braid.models (the reference model's
template, tasks and test checkpoints), braid.evals, braid.train, and braid.cli.
"""

__version__ = "0.1.0"
