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
from typing import Any, Dict, List, Optional

from cvllm.engine import wire
from cvllm.sampling_params import SamplingParams
from cvllm.utils import channel as ch

RPC_METHODS = ("metrics", "check_structured")
SIGNALS = ("SIGTERM", "SIGINT")


def _obj(d: Any, what: str) -> Dict[str, Any]:
    if not isinstance(d, dict):
        raise wire.WireError(f"{what}: a JSON object expected")
    return d


@dataclass
class Hello:
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

    def to_wire(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, d: Any) -> "Hello":
        d = _obj(d, "HELLO")
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
class EngineStatus:
    """The engine's health, pushed by rank 0 when it changes."""

    ready: bool
    healthy: bool
    error: Optional[str] = None

    def to_wire(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, d: Any) -> "EngineStatus":
        d = _obj(d, "STATUS")
        return cls(bool(d.get("ready")), bool(d.get("healthy")),
                   wire.optional_str(d.get("error"), "error"))


@dataclass
class Submit:
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
            return wire.request_id(_obj(d, "ADD").get("id"))
        except wire.WireError:
            return None

    @classmethod
    def from_wire(cls, d: Any) -> "Submit":
        d = _obj(d, "ADD")
        return cls(wire.request_id(d.get("id")), wire.token_ids(d.get("prompt"), "prompt"),
                   wire.params_from_wire(d.get("params")))


@dataclass
class RpcCall:
    """A question for rank 0, answered by an ``RpcReply`` with the same ``call``."""

    call: int
    method: str
    args: Dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, d: Any) -> "RpcCall":
        d = _obj(d, "RPC")
        method = d.get("method")
        if method not in RPC_METHODS:
            raise wire.WireError(f"unknown RPC method {method!r:.60}")
        return cls(wire.want(d.get("call"), int, "call"), method,
                   _obj(d.get("args") or {}, "RPC args"))


@dataclass
class RpcReply:
    call: int
    ok: bool
    result: Any = None
    error: Optional[Dict[str, Any]] = None
    """``utils.channel.error_info`` of what the call raised."""

    def to_wire(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, d: Any) -> "RpcReply":
        d = _obj(d, "RPC_REPLY")
        err = d.get("error")
        return cls(wire.want(d.get("call"), int, "call"), bool(d.get("ok")),
                   d.get("result"), None if err is None else _obj(err, "RPC error"))


@dataclass
class Signal:
    """A SIGTERM / SIGINT rank 0 received, for the API process to act on as if it were
    its own (drain, or abort at once on the second); the API process ignores signals
    sent to it directly, so a signal that reaches both processes counts once."""

    name: str

    def to_wire(self) -> Dict[str, Any]:
        return {"name": self.name}

    @classmethod
    def from_wire(cls, d: Any) -> "Signal":
        name = _obj(d, "SIGNAL").get("name")
        if name not in SIGNALS:
            raise wire.WireError(f"unknown signal {name!r:.40}")
        return cls(name)
