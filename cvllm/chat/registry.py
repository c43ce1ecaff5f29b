"""One kind of parser by name: the tool-call and reasoning parser tables
(``chat/tool_parsers``, ``chat/reasoning.py``) are each a ``ParserTable``.

Built once at import by those modules; read at start-up (``cli.py``'s flag check, the
server's agent set-up picking the parsers for a model) and where a request names its
parser. Pure Python.
"""

from dataclasses import dataclass
from typing import Generic, Mapping, Optional, Sequence, Tuple, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class ParserTable(Generic[T]):
    """The classes of one kind of parser by name, and the names a model's chat template or
    HF architecture implies."""

    what: str
    """The kind, as an error names it (``"tool-call parser"``)."""
    classes: Mapping[str, T]
    """Every name and alias -> its class."""
    template_markers: Sequence[Tuple[str, str]]
    """``(marker, name)``: a chat template that writes ``marker`` is for parser ``name``;
    the first listed that the template holds wins."""
    architectures: Mapping[str, str]
    """HF architecture name -> parser name, for a template that tells nothing."""
    template_gate: Tuple[str, ...] = ()
    """When set, the template speaks only if it holds one of these (the think tags);
    then ``template_default`` is its name where no marker matches."""
    template_default: Optional[str] = None

    def get(self, name: str) -> T:
        """The class for ``name``; for a name not in the table, a ValueError naming every
        known one."""
        try:
            return self.classes[name]
        except (KeyError, TypeError):
            known = ", ".join(sorted(self.classes))
            raise ValueError(f"unknown {self.what} {name!r}; known: {known}") from None

    def detect(self, architecture: Optional[str], chat_template: Optional[str]) -> Optional[str]:
        """The parser name for a model: from its chat template, else from its HF
        architecture name; None when neither names one."""
        template = chat_template or ""
        if not self.template_gate or any(tag in template for tag in self.template_gate):
            for marker, name in self.template_markers:
                if marker in template:
                    return name
            if self.template_default is not None:
                return self.template_default
        return self.architectures.get(architecture or "")
