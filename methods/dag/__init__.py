"""Agent workflows as DAGs of calls (Prompt Choreography), run in dependency order on one engine.

A node is one call of one agent: it reads its parents' messages, each at an offset (cached, or re-encoded in its
own context), then encodes its prompt and may decode a reply after it; nodes whose parents are done run together,
so parallel agents share every forward. The package, one module per job:
- graph: the graph model (Edge, Node, Graph) and its validation, and the order it runs in;
- context: how a node reads its parents, and leakage control (private nodes, and encodings that saw them);
- run: the wave loop (DagRun, run_dag), with what it keeps per node in state;
- streaming: staircase nodes (Staircase Streaming), which read their parents' replies as they decode;
- adapted: calibrated reading (Parallel-Synthesis's calibration) and the turn LoRA;
- remote: what a run asks of an executor that decodes its waves on other replicas;
- presets: the papers' workflows (MADiter, MADpar, ToT, MoA) as graphs.
"""

from braid.methods.dag.events import NodeDone, NodeRound, NodeToken
from braid.methods.dag.graph import Edge, Graph, Node
from braid.methods.dag.remote import WaveExecutor, WaveStream
from braid.methods.dag.run import DagRun, run_dag

__all__ = ["DagRun", "Edge", "Graph", "Node", "NodeDone", "NodeRound", "NodeToken", "WaveExecutor", "WaveStream",
           "run_dag"]
