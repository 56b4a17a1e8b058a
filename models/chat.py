"""The chat template of Braid's reference model: one special token per role.

Workflows are built from separately encoded messages, so each turn renders on its
own: `turn(role, text)` is a whole message, `header(role)` opens a turn that the
model completes and closes with END. CHAT_TEMPLATE renders the same strings from a
list of {"role", "content"} dicts for tools that use `apply_chat_template`.
"""

ROLES = ("system", "user", "worker", "synthesizer")
END = "<|end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [PAD, END, *(f"<|{r}|>" for r in ROLES)]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|{{ generation_role | default('synthesizer') }}|>{% endif %}"
)


def header(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    return f"<|{role}|>"


def turn(role: str, text: str) -> str:
    return header(role) + text + END


WORKER_HEADER = header("worker")
SYNTHESIZER_HEADER = header("synthesizer")


# ---- any model's own chat template, one message at a time ------------------------------------------------------
# Braid's roles, and the template role each is rendered as by default: a worker's reply and the synthesizer's
# answer are assistant turns. The reference model has a token of its own for each (REFERENCE_ROLES).
DEFAULT_ROLES = {"system": "system", "user": "user", "worker": "assistant", "synthesizer": "assistant"}
REFERENCE_ROLES = {r: r for r in ROLES}


class TemplateError(ValueError):
    """A chat template that cannot render Braid's messages one at a time (or a role Braid does not know)."""


def chat_renderer(tokenizer, name: str = "") -> "ChatRenderer | str":
    """The model's renderer, or why it has none (said to a request that sends chat messages)."""
    try:
        return ChatRenderer(tokenizer, name)
    except TemplateError as e:
        return str(e)


class ChatRenderer:
    """Renders chat messages with a model's own chat template (its tokenizer's `chat_template`), one message
    at a time, as Braid encodes them: each message apart, at its own offset, after the messages it reads.

    A Hugging Face template renders whole conversations, so a message is rendered as the difference between the
    conversation with it and without it (`render(messages, before)`), and a turn the model is to complete opens
    with the difference the generation prompt makes (`header(role, before)`). That is only sound where rendering
    is stable: the conversation without the message must be a prefix of the conversation with it. Where it is not
    (a template that reorders turns, or rejects the roles in the order Braid gives them), the renderer refuses,
    naming the model and the reason; so does a template that injects today's date (`strftime_now`), since a
    cached encoding would then change from day to day. `roles` maps Braid's roles (system, user, worker,
    synthesizer) to the template's (DEFAULT_ROLES unless the model has a token for each of Braid's, as the
    reference model does)."""

    def __init__(self, tokenizer, name: str = "", roles: dict[str, str] | None = None):
        self.tokenizer, self.name = tokenizer, name or getattr(tokenizer, "name_or_path", "") or "this model"
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise TemplateError(f"model {self.name} has no chat template (its tokenizer config names none): send "
                                "raw strings, or add one to its tokenizer_config.json")
        if "strftime_now" in str(template):
            raise TemplateError(f"model {self.name}'s chat template writes today's date into its prompts, so a "
                                "message's encoding would change from day to day: give the model a template "
                                "without it (or pass date_string) to serve chat messages")
        specials = set(getattr(tokenizer, "all_special_tokens", ()))
        self.roles = dict(roles or (REFERENCE_ROLES if all(f"<|{r}|>" in specials for r in ROLES) else DEFAULT_ROLES))
        unknown = set(self.roles) ^ set(ROLES)
        if unknown:
            raise TemplateError(f"the role map must name exactly Braid's roles {', '.join(ROLES)}; got "
                                f"{sorted(self.roles)}")

    def _as_template(self, messages) -> list[dict[str, str]]:
        out = []
        for m in messages:
            role, content = (m["role"], m["content"]) if isinstance(m, dict) else (m.role, m.content)
            if role not in self.roles:
                raise TemplateError(f"role {role!r} is not one of {', '.join(ROLES)}")
            out.append({"role": self.roles[role], "content": content})
        return out

    def _whole(self, messages: list[dict[str, str]], generation_role: str | None = None) -> str:
        if not messages and generation_role is None:
            return ""
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_role is not None,
                **({"generation_role": generation_role} if generation_role is not None else {}))
        except Exception as e:  # noqa: BLE001 - the template's own refusal (e.g. roles that must alternate)
            roles = ", ".join(m["role"] for m in messages) or "none"
            raise TemplateError(f"model {self.name}'s chat template cannot render the roles {roles} in this order "
                                f"({type(e).__name__}: {e}); map Braid's roles to others (roles=...)") from None

    def _after(self, before: list[dict[str, str]], whole: str, what: str) -> str:
        base = self._whole(before)
        if not whole.startswith(base):
            raise TemplateError(f"model {self.name}'s chat template does not render {what} stably: the "
                                "conversation before it is not a prefix of the conversation with it, so it cannot "
                                "be encoded apart")
        return whole[len(base):]

    def render(self, messages, before=()) -> str:
        """The text of `messages` as they render after `before` (messages already encoded, which they follow)."""
        before, messages = self._as_template(before), self._as_template(messages)
        return self._after(before, self._whole(before + messages), f"{len(messages)} message(s)")

    def workflow(self, task, branches, synthesis) -> tuple[str, list[str], str, str]:
        """A parallel-synthesis workflow given as chat messages, as its parts are encoded: (the task, each branch's
        prompt after it, the synthesis prompt after the task and the workers' turns with the synthesizer's header
        opening its answer, the header opening each worker's reply). The API (RunWorkflow) and the trainer
        (`braid calibrate --traces`) render workflows here, so a calibration trains on the layout served."""
        task, branches, synthesis = list(task), [list(b) for b in branches], list(synthesis)
        prompts = [self.render(b, task) for b in branches]
        headers = {self.header("worker", [*task, *b]) for b in branches}
        if len(headers) > 1:
            raise TemplateError(f"model {self.name}'s chat template opens the workers' turns differently from "
                                f"branch to branch ({sorted(headers)}); send strings instead")
        replies = [{"role": "worker", "content": "x"} for _ in branches]  # (the synthesizer reads their turns)
        answer = (self.render(synthesis, [*task, *replies]) if synthesis else "") + \
            self.header("synthesizer", [*task, *replies, *synthesis])
        return self.render(task) if task else "", prompts, answer, headers.pop() if headers else ""

    def header(self, role: str, before=()) -> str:
        """The text that opens a turn of `role` for the model to complete, after `before`."""
        if role not in self.roles:
            raise TemplateError(f"role {role!r} is not one of {', '.join(ROLES)}")
        # (a template renders no empty conversation: a turn that opens one is measured after a user message)
        before = self._as_template(before) or [{"role": self.roles["user"], "content": "x"}]
        return self._after(before, self._whole(before, self.roles[role]), f"a {role} turn's header")


def task_renderer(tokenizer, name: str = "") -> "ChatRenderer | None":
    """How Braid's synthetic tasks (models.tasks) are laid out for this model, as it serves workflows. None where that
    is the reference model's role tokens (`turn`, `header`): a model without a chat template is served raw strings
    whose workers' turns open with the reference header (the cluster config's `worker_header`), and the reference
    template renders exactly those strings. Otherwise the model's own renderer, which lays a task out from its chat
    messages as RunWorkflow lays out chat messages (ChatRenderer.workflow), so that a calibration trains, and an eval
    measures, the layout served. A template that cannot render them is a TemplateError naming the model and why."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    r = ChatRenderer(tokenizer, name)
    system, user = {"role": "system", "content": " x"}, {"role": "user", "content": " y"}
    r.workflow([system], [[user], [user]], [user])  # (refuses a template that cannot render a workflow)
    same = (r.render([system]) == turn("system", " x") and r.render([user], [system]) == turn("user", " y")
            and r.header("worker", [system, user]) == WORKER_HEADER
            and r.header("synthesizer", [system, user]) == SYNTHESIZER_HEADER)
    return None if same else r
