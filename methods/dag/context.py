"""How a DAG node reads its parents: its context (messages at offsets) built over the engine, with the re-encoded
copies that text parents and leakage control need.

How a node reads a parent:
- cached (choreographed, the default): the parent's own encoding, reused as is;
- re-encoded: the parent's tokens encoded again in the reader's context, after the reader's earlier parents
  (what a text pipeline does). A parent with `output="text"` is read this way by every child.

Leakage control (Prompt Choreography, section 3.4). A `private` node is seen only by nodes of its own role. An
encoding that attended to another role's private node, directly or through cached parents, would let the reader
see it through the back door; by default such a parent is read through a copy re-encoded without those ancestors
(each of its context's items kept where clean, dropped where private, re-encoded otherwise). An edge with
`leak=True` reads the cached encoding anyway: the choice is explicit.
"""

from collections.abc import Callable, Sequence

from braid.engine.engine import Engine, PrefillCall
from braid.methods.dag.graph import Edge, Graph, Node
from braid.methods.dag.state import Item, NodeState


class Reader:
    """Builds the contexts of one run's nodes from their parents' outputs (`states`). Each copy it encodes is
    handed to `keep`, which holds it from eviction until the run frees it."""

    def __init__(self, engine: Engine, graph: Graph, states: dict[str, NodeState], keep: Callable[[str], None]):
        self.engine, self.graph, self.states, self._keep = engine, graph, states, keep

    def read(self, n: Node, parents: Sequence[Edge] | None = None) -> tuple[list[Item], list[str]]:
        """The node's context (from `parents`, default all of its parents), in order, and a note per parent
        read through a re-encoded copy. Consecutive parents read as text are re-encoded together, in one
        prefill, as a text prompt would hold them."""
        ctx: list[Item] = []
        notes: list[str] = []
        run: list[int] = []  # tokens of text parents waiting to be re-encoded together
        run_at = 0
        for e in n.parents if parents is None else parents:
            p = self.graph.node(e.node) if e.node else None
            if p is not None and p.output == "text" and not p.private and (not run or e.offset is None):
                if not run:
                    run_at = self.offset(e.offset, ctx)
                run += self._tokens(p.name)
                notes.append(f"{p.name}:text")
                continue
            if run:
                ctx.append(self._reencode(run, run_at, ctx))
                run = []
            at = self.offset(e.offset, ctx)
            if p is not None and p.output == "text" and not p.private:  # (at its own offset: a run of its own)
                run, run_at = self._tokens(p.name), at
                notes.append(f"{p.name}:text")
            else:
                ctx.append(self._item(e, p, n.role, at, ctx, notes))
        if run:
            ctx.append(self._reencode(run, run_at, ctx))
        return ctx, notes

    def _item(self, e: Edge, p: Node | None, role: str, at: int, ctx: list[Item], notes: list[str]) -> Item:
        """Parent `e` (node p, None for a session message) as a reader of `role` reads it at `at`, after `ctx`: a
        private text parent re-encoded (its tokens are the private text itself), a cached parent as it is where
        clean (or where the edge leaks), through a copy without what the role may not see otherwise."""
        if p is None:  # a session message: nothing private in it
            return Item(e.message, at, frozenset())
        if p.output == "text":  # (private: its own item)
            item = self._reencode(self._tokens(p.name), at, ctx)
            notes.append(f"{p.name}:text")
            return Item(item.message, at, item.taint | {p.name}, p.name)
        parent = self.states[p.name]
        if e.leak or self.clean(parent.taint, role):
            return Item(parent.message, at, parent.taint, p.name)
        copy = self.without_private(p.name, role)
        notes.append(f"{p.name}:private")
        return Item(copy.message, at, copy.taint, p.name)

    def clean(self, taint: frozenset[str], role: str) -> bool:
        """Whether a reader of `role` may see an encoding that attended to the private nodes `taint`."""
        return all(self.graph.node(t).role == role for t in taint)

    def taint_of(self, n: Node) -> frozenset[str]:
        """The private nodes node n's encoding attends to: its context's, and itself if it is private."""
        taint = frozenset().union(*(i.taint for i in self.states[n.name].context))
        return taint | ({n.name} if n.private else set())

    def offset(self, offset: int | None, ctx: list[Item]) -> int:
        """Where a parent read at `offset` goes (None: directly after the context `ctx` so far)."""
        if offset is not None:
            return offset
        if not ctx:
            return 0
        last = self.engine.message(ctx[-1].message)
        return ctx[-1].offset + last.num_tokens

    def without_private(self, name: str, role: str) -> Item:
        """A copy of node `name`'s output encoded without what `role` may not see: its context rebuilt (clean
        items kept, other roles' private nodes dropped, the rest re-encoded after what is kept), then its
        own tokens re-encoded after that, where they were. Made once per role."""
        state = self.states[name]
        if role not in state.visible:
            rebuilt: list[Item] = []
            for item in state.context:
                if self.clean(item.taint, role):
                    rebuilt.append(item)
                elif item.source and self.graph.node(item.source).private:
                    continue  # another role's private node: not seen at all
                else:
                    rebuilt.append(self._reencode(self.engine.message(item.message).token_ids, item.offset, rebuilt))
            own = self.engine.message(state.message)
            state.visible[role] = self._reencode(own.token_ids, own.offset, rebuilt)  # (taint: what was kept)
        return state.visible[role]

    def _tokens(self, name: str) -> list[int]:
        """Node `name`'s output message's tokens."""
        return list(self.engine.message(self.states[name].message).token_ids)

    def _reencode(self, tokens: Sequence[int], at: int, ctx: list[Item]) -> Item:
        """`tokens` encoded at `at`, after the context `ctx` (its taint: the context's)."""
        new, = self.engine.prefill([PrefillCall(list(tokens), parents=[i.message for i in ctx],
                                                offsets=[i.offset for i in ctx], new_offset=at)])
        self._keep(new)
        return Item(new, at, frozenset().union(*(i.taint for i in ctx)) if ctx else frozenset())
