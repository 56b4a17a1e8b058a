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
