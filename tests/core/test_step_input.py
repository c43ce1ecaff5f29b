import struct
import zlib

import numpy as np
import pytest

from cvllm.core.block_manager import BlockManager
from cvllm.core.scheduler_output import ScheduledSeq, SchedulerOutput
from cvllm.core.sequence import Sequence
from cvllm.core.step_builder import build_step_input
from cvllm.core.step_input import StepInput, unpack_message
from cvllm.core.wire_format import (
    HEADER_SIZE,
    ControlMessage,
    MessageHeader,
    MessageKind,
    StepInputError,
)
from cvllm.sampling_params import SamplingParams

BS = 4


def _mixed_step(step_id=7):
    """A decode (seq 0), a middle prefill chunk (seq 1) and a final prefill chunk (seq 2)."""
    bm = BlockManager(num_blocks=32, block_size=BS)
    # Burn some blocks so block ids are not simply 0..n.
    burn = Sequence(99, "burn", [1], SamplingParams())
    bm.allocate(burn, 3 * BS)

    dec = Sequence(0, "a", list(range(10, 19)), SamplingParams(temperature=0.7, seed=2**63 - 1))
    dec.append_token(500)  # 10 tokens, 9 computed
    dec.num_computed_tokens = 9
    bm.allocate(dec, 1)  # 3 blocks
    mid = Sequence(1, "b", list(range(20, 40)), SamplingParams(top_k=5, seed=-(2**63)))
    mid.num_computed_tokens = 4
    bm.allocate(mid, 6)  # 10 of 20 tokens -> 3 blocks
    last = Sequence(2, "c", list(range(40, 46)), SamplingParams(top_p=0.5, min_p=0.1,
                                                               repetition_penalty=1.3))
    bm.allocate(last, 6)  # 2 blocks
    scheduled = [
        ScheduledSeq(dec, 1, True), ScheduledSeq(mid, 6, False), ScheduledSeq(last, 6, True)
    ]
    return SchedulerOutput(step_id, scheduled), (dec, mid, last), bm


def test_build_step_input_layout():
    out, (dec, mid, last), bm = _mixed_step()
    si = build_step_input(out, BS)
    si.validate(block_size=BS, num_blocks=bm.num_total_blocks)
    assert si.num_tokens == 13 and si.num_seqs == 3 and si.num_samples == 2
    assert si.input_ids.tolist() == [500] + list(range(24, 30)) + list(range(40, 46))
    assert si.positions.tolist() == [9] + list(range(4, 10)) + list(range(0, 6))
    assert si.query_start_loc.tolist() == [0, 1, 7, 13]
    assert si.seq_lens.tolist() == [10, 10, 6]
    assert si.max_query_len == 6 and si.max_seq_len == 10
    assert si.block_tables.shape == (3, 3)
    assert si.block_tables[0].tolist() == dec.block_ids
    assert si.block_tables[2].tolist() == last.block_ids + [0]  # zero padding
    expected_slots = [dec.block_ids[9 // BS] * BS + 9 % BS]
    expected_slots += [mid.block_ids[p // BS] * BS + p % BS for p in range(4, 10)]
    expected_slots += [last.block_ids[p // BS] * BS + p % BS for p in range(6)]
    assert si.slot_mapping.tolist() == expected_slots
    assert si.slot_mapping.dtype == np.int64
    assert si.logits_indices.tolist() == [0, 12] and si.sample_rows.tolist() == [0, 2]


def test_build_step_input_sampling_rows():
    out, (dec, mid, last), _ = _mixed_step()
    si = build_step_input(out, BS)
    assert si.temperature.tolist() == pytest.approx([0.7, 1.0])
    assert si.top_p.tolist() == pytest.approx([1.0, 0.5])
    assert si.min_p.tolist() == pytest.approx([0.0, 0.1])
    assert si.repetition_penalty.tolist() == pytest.approx([1.0, 1.3])
    assert si.top_k.tolist() == [-1, -1]
    assert si.has_seed.tolist() == [1, 0]
    assert si.seeds.tolist() == [2**63 - 1, 0]
    assert si.output_index.tolist() == [1, 0]  # dec already generated one token


def test_build_rejects_sequence_without_blocks():
    seq = Sequence(0, "a", [1, 2, 3], SamplingParams())
    with pytest.raises(ValueError, match="too few blocks"):
        build_step_input(SchedulerOutput(1, [ScheduledSeq(seq, 3, True)]), BS)


def test_round_trip_mixed():
    out, _, _ = _mixed_step()
    si = build_step_input(out, BS)
    buf = si.pack()
    back = StepInput.unpack(buf)
    assert back == si and back.step_id == 7
    assert back.seeds.dtype == np.int64 and back.block_tables.shape == (3, 3)
    assert isinstance(unpack_message(buf), StepInput)


def test_round_trip_extreme_seeds():
    out, _, _ = _mixed_step()
    si = build_step_input(out, BS)
    si.seeds = np.array([-(2**63), 2**63 - 1], np.int64)
    si.has_seed = np.array([1, 1], np.int32)
    assert StepInput.unpack(si.pack()).seeds.tolist() == [-(2**63), 2**63 - 1]


def test_round_trip_empty_batch():
    si = build_step_input(SchedulerOutput(3, []), BS)
    assert si == StepInput.empty(3)
    back = StepInput.unpack(si.pack())
    assert back == si and back.num_tokens == back.num_seqs == back.num_samples == 0
    assert back.query_start_loc.tolist() == [0] and back.block_tables.shape == (0, 0)
    assert back.max_query_len == 0 and back.max_seq_len == 0


def test_round_trip_no_sampling_rows():
    out, (_, mid, _), _ = _mixed_step()
    out.scheduled = [out.scheduled[1]]
    si = build_step_input(out, BS)
    assert si.num_samples == 0 and si.num_seqs == 1
    assert StepInput.unpack(si.pack()) == si


def test_equality_sees_differences():
    out, _, _ = _mixed_step()
    a, b = build_step_input(out, BS), build_step_input(out, BS)
    assert a == b
    b.top_p = b.top_p.copy()
    b.top_p[0] = 0.9
    assert a != b


@pytest.mark.parametrize("kind", [MessageKind.ABORT, MessageKind.SHUTDOWN, MessageKind.HEARTBEAT])
def test_control_messages_round_trip(kind):
    buf = ControlMessage(kind, 12).pack()
    assert len(buf) == HEADER_SIZE
    assert ControlMessage.unpack(buf) == ControlMessage(kind, 12)
    assert unpack_message(buf) == ControlMessage(kind, 12)
    with pytest.raises(StepInputError, match="expected a STEP"):
        StepInput.unpack(buf)


# ----- corrupt buffers --------------------------------------------------------------


def _packed():
    out, _, _ = _mixed_step()
    return build_step_input(out, BS).pack()


def _reseal(body: bytes, step_id=7, kind=MessageKind.STEP) -> bytes:
    """A message with a valid header and crc around an arbitrary body."""
    return MessageHeader(kind, step_id, len(body), zlib.crc32(body)).pack() + body


def test_corrupt_body_fails_crc():
    buf = bytearray(_packed())
    buf[HEADER_SIZE + 40] ^= 0xFF
    with pytest.raises(StepInputError, match="crc32"):
        StepInput.unpack(bytes(buf))


@pytest.mark.parametrize("offset,value,match", [
    (0, b"XXXX", "magic"),
    (4, struct.pack("<H", 99), "version"),
    (6, struct.pack("<H", 9), "kind"),
])
def test_bad_header_fields(offset, value, match):
    buf = bytearray(_packed())
    buf[offset:offset + len(value)] = value
    with pytest.raises(StepInputError, match=match):
        StepInput.unpack(bytes(buf))


def test_every_truncation_is_rejected():
    buf = _packed()
    for n in range(len(buf)):
        with pytest.raises(StepInputError):
            StepInput.unpack(buf[:n])


def test_trailing_bytes_rejected():
    with pytest.raises(StepInputError, match="trailing|truncated"):
        StepInput.unpack(_packed() + b"\0")


def test_trailing_bytes_inside_sealed_body_rejected():
    body = _packed()[HEADER_SIZE:] + b"\0\0\0\0"
    with pytest.raises(StepInputError, match="trailing data in STEP body"):
        StepInput.unpack(_reseal(body))


def test_oversized_body_rejected_before_reading_it():
    header = MessageHeader(MessageKind.STEP, 1, 2**40, 0).pack()
    with pytest.raises(StepInputError, match="exceeds"):
        StepInput.unpack(header)
    with pytest.raises(StepInputError, match="exceeds"):
        StepInput.unpack(_packed(), max_body_bytes=64)


def test_huge_shape_rejected_before_allocating():
    body = bytearray(_packed()[HEADER_SIZE:])
    # First array (input_ids): count u32, desc <HBB>, then its one dim u32 at offset 8.
    body[8:12] = struct.pack("<I", 2**32 - 1)
    with pytest.raises(StepInputError, match="truncated reading input_ids data"):
        StepInput.unpack(_reseal(bytes(body)))


def test_wrong_dtype_code_rejected():
    body = bytearray(_packed()[HEADER_SIZE:])
    body[6] = 3  # input_ids claims float32
    with pytest.raises(StepInputError, match="dtype code"):
        StepInput.unpack(_reseal(bytes(body)))


def test_unknown_and_duplicate_names_rejected():
    body = bytearray(_packed()[HEADER_SIZE:])
    body[4:6] = struct.pack("<H", 200)
    with pytest.raises(StepInputError, match="unknown array"):
        StepInput.unpack(_reseal(bytes(body)))
    body[4:6] = struct.pack("<H", 2)  # input_ids relabelled positions; positions follows
    with pytest.raises(StepInputError, match="twice"):
        StepInput.unpack(_reseal(bytes(body)))


def test_inconsistent_shapes_rejected():
    out, _, _ = _mixed_step()
    si = build_step_input(out, BS)
    si.positions = si.positions[:-1]
    with pytest.raises(StepInputError, match="positions has shape"):
        si.pack()


def test_control_message_with_body_rejected():
    with pytest.raises(StepInputError, match="empty body"):
        unpack_message(_reseal(b"abc", kind=MessageKind.HEARTBEAT))


# ----- validate ---------------------------------------------------------------------


def _valid():
    out, _, bm = _mixed_step()
    return build_step_input(out, BS)


@pytest.mark.parametrize("mutate,match", [
    (lambda s: s.query_start_loc.__setitem__(1, 8), "strictly increasing|positions"),
    (lambda s: s.query_start_loc.__setitem__(3, 12), "from 0 to T"),
    (lambda s: s.slot_mapping.__setitem__(0, -1), "non-negative"),
    (lambda s: s.seq_lens.__setitem__(2, 3), "seq_lens"),
    (lambda s: s.positions.__setitem__(0, 3), "positions"),
    (lambda s: s.logits_indices.__setitem__(1, 11), "logits_indices"),
    (lambda s: s.sample_rows.__setitem__(1, 5), "sample_rows"),
    (lambda s: s.top_p.__setitem__(0, 0.0), "top_p"),
    (lambda s: s.temperature.__setitem__(0, np.nan), "finite"),
    (lambda s: s.has_seed.__setitem__(0, 2), "has_seed"),
    (lambda s: setattr(s, "input_ids", s.input_ids.astype(np.int64)), "input_ids must be"),
])
def test_validate_rejects(mutate, match):
    si = _valid()
    mutate(si)
    with pytest.raises(StepInputError, match=match):
        si.validate()


def test_validate_slots_against_block_tables():
    si = _valid()
    si.validate(block_size=BS, num_blocks=32)
    with pytest.raises(StepInputError, match="num_blocks"):
        si.validate(block_size=BS, num_blocks=4)
    si.slot_mapping[3] += 1
    si.validate()  # without block_size the slots are only checked for sign
    with pytest.raises(StepInputError, match="slot_mapping"):
        si.validate(block_size=BS)
