"""The messages of the channel between rank 0's engine and the API process, as named
dataclasses with their JSON codecs (``utils/channel.py`` frames them; ``engine/wire.py``
encodes what they carry).

Rank 0 (``runtime/api_host.py``) builds ``Hello``, ``EngineStatus``, ``RpcReply`` and the
``Signal`` it forwards; the API process (``server/remote_engine.py``,
``server/api_process.py``) builds ``Submit`` and ``RpcCall``. Each ``from_wire`` checks
every field's type before the other side acts on it. Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Type, TypeVar

from cvllm.engine import wire
from cvllm.sampling_params import SamplingParams
from cvllm.utils import channel as ch

RPC_METHODS = ("metrics", "check_structured")
SIGNALS = ("SIGTERM", "SIGINT")


def _obj(d: Any, what: str) -> Dict[str, Any]:
    if not isinstance(d, dict):
        raise wire.WireError(f"{what}: a JSON object expected")
    return d


M = TypeVar("M", bound="WireMessage")


class WireMessage:
    """A message dataclass and its JSON: its fields (``to_wire``) unless it says otherwise;
    ``from_wire`` takes only a JSON object (named by ``kind`` in the error) and hands it to
    the message's ``from_object``, which checks every field."""

    kind: ClassVar[str]
    """The frame's name (``class Hello(WireMessage, kind="HELLO")``), for errors."""

    def __init_subclass__(cls, kind: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.kind = kind

    def to_wire(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls: Type[M], d: Any) -> M:
        return cls.from_object(_obj(d, cls.kind))

    @classmethod
    def from_object(cls: Type[M], d: Dict[str, Any]) -> M:
        raise NotImplementedError


@dataclass
class Hello(WireMessage, kind="HELLO"):
    """Rank 0's first message: what the API process needs to serve this engine."""

    model_name: str
    max_model_len: int
    default_params: Dict[str, Any]
    """The server-wide sampling defaults (``AsyncEngine.default_params``)."""
    settings: Dict[str, Any]
    """``server.context.ServerSettings`` fields."""
    shutdown_timeout_s: float
    tokenizer_dir: str
    """A folder the engine's tokenizer was saved to (``save_pretrained``)."""
    chat_template: str
    probe_text: str
    probe_ids: List[int]
    """``probe_text`` as the engine's tokenizer encodes it: the copy must agree."""
    mcp: Dict[str, Any] = field(default_factory=dict)
    """``--mcp-config`` / ``--mcp-command`` / ``--mcp-args`` / ``--mcp-call-timeout``."""
    version: int = ch.VERSION

    @classmethod
    def from_object(cls, d: Dict[str, Any]) -> "Hello":
        if d.get("version") != ch.VERSION:
            raise wire.WireError(f"channel version {d.get('version')!r} from the engine, "
                                 f"{ch.VERSION} here")
        try:
            hello = cls(**d)
        except TypeError as e:
            raise wire.WireError(f"HELLO: {e}") from None
        for name, kind in (("model_name", str), ("max_model_len", int), ("tokenizer_dir", str),
                           ("chat_template", str), ("probe_text", str), ("default_params", dict),
                           ("settings", dict), ("mcp", dict), ("shutdown_timeout_s", (int, float))):
            wire.want(getattr(hello, name), kind, name)
        wire.token_ids(hello.probe_ids, "probe_ids")
        return hello


@dataclass
class EngineStatus(WireMessage, kind="STATUS"):
    """The engine's health, pushed by rank 0 when it changes."""

    ready: bool
    healthy: bool
    error: Optional[str] = None

    @classmethod
    def from_object(cls, d: Dict[str, Any]) -> "EngineStatus":
        return cls(bool(d.get("ready")), bool(d.get("healthy")),
                   wire.optional_str(d.get("error"), "error"))


@dataclass
class Submit(WireMessage, kind="ADD"):
    """A request for the engine (ADD)."""

    request_id: str
    prompt_token_ids: List[int]
    params: SamplingParams

    def to_wire(self) -> Dict[str, Any]:
        return {"id": self.request_id, "prompt": list(self.prompt_token_ids),
                "params": wire.params_to_wire(self.params)}

    @staticmethod
    def id_of(d: Any) -> Optional[str]:
        """The request id of an ADD, if it has a well-formed one (for its error)."""
        try:
            return wire.request_id(_obj(d, Submit.kind).get("id"))
        except wire.WireError:
            return None

    @classmethod
    def from_object(cls, d: Dict[str, Any]) -> "Submit":
        return cls(wire.request_id(d.get("id")), wire.token_ids(d.get("prompt"), "prompt"),
                   wire.params_from_wire(d.get("params")))


@dataclass
class RpcCall(WireMessage, kind="RPC"):
    """A question for rank 0, answered by an ``RpcReply`` with the same ``call``."""

    call: int
    method: str
    args: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_object(cls, d: Dict[str, Any]) -> "RpcCall":
        method = d.get("method")
        if method not in RPC_METHODS:
            raise wire.WireError(f"unknown RPC method {method!r:.60}")
        return cls(wire.want(d.get("call"), int, "call"), method,
                   _obj(d.get("args") or {}, "RPC args"))


@dataclass
class RpcReply(WireMessage, kind="RPC_REPLY"):
    call: int
    ok: bool
    result: Any = None
    error: Optional[Dict[str, Any]] = None
    """``utils.channel.error_info`` of what the call raised."""

    @classmethod
    def from_object(cls, d: Dict[str, Any]) -> "RpcReply":
        err = d.get("error")
        return cls(wire.want(d.get("call"), int, "call"), bool(d.get("ok")),
                   d.get("result"), None if err is None else _obj(err, "RPC error"))


@dataclass
class Signal(WireMessage, kind="SIGNAL"):
    """A SIGTERM / SIGINT rank 0 received, for the API process to act on as if it were
    its own (drain, or abort at once on the second); the API process ignores signals
    sent to it directly, so a signal that reaches both processes counts once."""

    name: str

    @classmethod
    def from_object(cls, d: Dict[str, Any]) -> "Signal":
        name = d.get("name")
        if name not in SIGNALS:
            raise wire.WireError(f"unknown signal {name!r:.40}")
        return cls(name)
