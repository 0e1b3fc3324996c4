"""Which roles a chat template takes: the standard four plus any its Jinja source compares a
message's role with. Both fronts check a chat's roles against this before rendering it."""

from __future__ import annotations

import functools

# The roles every chat template is written for (OpenAI's and Hugging Face's conventions).
STANDARD_CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


@functools.lru_cache(maxsize=8)
def chat_roles(template: str | None) -> frozenset[str]:
    """The standard roles plus any other the template names: the string constants it compares a
    message's role with (`message['role'] == 'ipython'`, `m.role in ['developer', ...]`)."""
    return STANDARD_CHAT_ROLES | _template_roles(template) if template else STANDARD_CHAT_ROLES


def _template_roles(template: str) -> frozenset[str]:
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:   # a tag of transformers' own ({% generation %}): only the standard roles
        return frozenset()

    def is_role(e) -> bool:
        return ((isinstance(e, nodes.Getitem) and isinstance(e.arg, nodes.Const) and e.arg.value == "role")
                or (isinstance(e, nodes.Getattr) and e.attr == "role"))

    def strings(e) -> set[str]:
        if isinstance(e, nodes.Const) and isinstance(e.value, str):
            return {e.value}
        if isinstance(e, (nodes.List, nodes.Tuple)):
            return {s for item in e.items for s in strings(item)}
        return set()

    roles: set[str] = set()
    for cmp in tree.find_all(nodes.Compare):
        operands = [cmp.expr, *(op.expr for op in cmp.ops)]
        if any(is_role(e) for e in operands):
            roles.update(s for e in operands for s in strings(e))
    return frozenset(roles)
