"""utils/channel.py: frames survive the trip whole (blocking and asyncio readers), a clean
close reads as None, and every malformed stream is refused with a ChannelError before
anything is allocated: a truncated header or payload, an announced length over the
limit, an unknown kind, bytes that are not JSON."""

import asyncio
import socket
import struct
import threading

import pytest

from cvllm.utils import channel as ch


def _pair():
    a, b = socket.socketpair()
    return a, b


def test_frames_round_trip_blocking_and_async():
    a, b = _pair()
    frames = [(ch.ADD, b'{"id":"x"}'), (ch.DRAIN, b""), (ch.ABORT, "r\u00e9q".encode()),
              (ch.OUTPUTS, b"[" + b"1," * 300_000 + b"1]")]  # larger than one recv
    w = ch.FrameWriter(a)
    t = threading.Thread(target=lambda: [w.send(ch.encode_frame(k, p)) for k, p in frames])
    t.start()
    r = ch.FrameReader(b)
    assert [r.read() for _ in frames] == frames
    t.join()
    a.close()
    assert r.read() is None  # closed between frames

    async def main():
        c, d = _pair()
        reader, _ = await asyncio.open_unix_connection(sock=d)
        sender = threading.Thread(target=lambda: [c.sendall(ch.encode_frame(k, p))
                                                  for k, p in frames])
        sender.start()  # (the large frame is more than the socket's buffer)
        got = [await ch.read_frame_async(reader) for _ in frames]
        sender.join()
        c.close()
        assert await ch.read_frame_async(reader) is None
        return got

    assert asyncio.run(main()) == frames


def test_json_frames_carry_any_string():
    text = "lone \ud800 surrogate, \u65e5\u672c, \x00 nul, \"quotes\""
    frame = ch.encode_json(ch.STATUS, {"error": text})
    length, kind = ch.HEADER.unpack(frame[:ch.HEADER.size])
    assert kind == ch.STATUS and length == len(frame) - ch.HEADER.size
    assert ch.decode_json(kind, frame[ch.HEADER.size:]) == {"error": text}
    with pytest.raises(ch.ChannelError, match="not valid JSON"):
        ch.decode_json(ch.STATUS, b"{nope")


@pytest.mark.parametrize("raw, match", [
    (struct.pack(">IB", 10, ch.ADD) + b"abc", "middle of a frame"),           # short payload
    (struct.pack(">IB", 10, ch.ADD)[:3], "middle of a frame"),                  # short header
    (struct.pack(">IB", ch.MAX_FRAME + 1, ch.OUTPUTS), "over the"),            # too long
    (struct.pack(">IB", 0, 200), "unknown frame kind 200"),                     # unknown kind
])
def test_malformed_streams_are_refused(raw, match):
    a, b = _pair()
    a.sendall(raw)
    a.close()
    with pytest.raises(ch.ChannelError, match=match):
        ch.FrameReader(b).read()

    async def main():
        c, d = _pair()
        reader, _ = await asyncio.open_unix_connection(sock=d)
        c.sendall(raw)
        c.close()
        await ch.read_frame_async(reader)

    with pytest.raises(ch.ChannelError, match=match):
        asyncio.run(main())


def test_senders_refuse_what_a_reader_would():
    with pytest.raises(ch.ChannelError, match="unknown frame kind"):
        ch.encode_frame(99, b"")
    big = bytearray(ch.MAX_FRAME + 1)
    with pytest.raises(ch.ChannelError, match="over the"):
        ch.encode_frame(ch.OUTPUTS, bytes(big))


def test_error_info_keeps_the_request_field():
    class Bad(ValueError):
        param = "response_format"

    assert ch.error_info(Bad("no")) == {"type": "Bad", "message": "no", "value_error": True,
                                        "param": "response_format"}
    assert ch.error_info(RuntimeError("dead"))["value_error"] is False
