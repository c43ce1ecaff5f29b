"""StepInput version 2: per-KV-group slot_mapping / block_tables (with placeholders of freed
out-of-window blocks) and linear-attention state slots round-trip, and every corrupt or
inconsistent value is rejected."""

import struct
import zlib

import numpy as np
import pytest

from cvllm.core.block_manager import PLACEHOLDER_BLOCK
from cvllm.core.kv_cache_manager import KVCacheGroupConfig, KVCacheLayout, KVCacheManager
from cvllm.core.scheduler_output import ScheduledSeq, SchedulerOutput
from cvllm.core.sequence import Sequence
from cvllm.core.step_builder import build_step_input
from cvllm.core.step_input import StepInput
from cvllm.core.wire_format import HEADER_SIZE, MessageHeader, MessageKind, StepInputError
from cvllm.sampling_params import SamplingParams

BS = 4
WINDOW = 5
LAYOUT = KVCacheLayout(
    BS, (KVCacheGroupConfig(None, 32, (0, 2)), KVCacheGroupConfig(WINDOW, 16, (1,))),
    num_state_slots=4,
)


def _grouped_step(step_id=9):
    """A long decode whose early sliding blocks were freed, and a fresh prefill."""
    kv = KVCacheManager.from_layout(LAYOUT)
    dec = Sequence(0, "a", list(range(10, 30)), SamplingParams(temperature=0.5))
    kv.allocate(dec, 20)
    dec.num_computed_tokens = 20
    kv.remove_out_of_window_blocks(dec)  # next query at 20 sees 16..20: blocks 0-3 freed
    dec.append_token(77)
    kv.allocate(dec, 1)
    kv.assign_state_slot(dec)
    new = Sequence(1, "b", list(range(40, 47)), SamplingParams())
    kv.allocate(new, 7)
    kv.assign_state_slot(new)
    out = SchedulerOutput(step_id, [ScheduledSeq(dec, 1, True), ScheduledSeq(new, 7, True)])
    return out, dec, new, kv


def test_build_carries_every_group_and_the_state_slots():
    out, dec, new, kv = _grouped_step()
    si = build_step_input(out, BS, LAYOUT.windows)
    si.validate(block_size=BS, num_blocks=[32, 16])
    assert si.num_kv_groups == 2 and si.kv_group_windows.tolist() == [0, WINDOW]
    assert si.block_tables[0].tolist() == dec.group_block_ids(0)
    sliding = dec.group_block_ids(1)
    assert sliding[:4] == [PLACEHOLDER_BLOCK] * 4 and PLACEHOLDER_BLOCK not in sliding[4:]
    window, slots, tables = si.kv_group(1)
    assert window == WINDOW and tables[0, :len(sliding)].tolist() == sliding
    assert slots[0] == sliding[20 // BS] * BS + 20 % BS
    assert slots[1:].tolist() == [new.group_block_ids(1)[p // BS] * BS + p % BS for p in range(7)]
    assert si.state_slots.tolist() == [dec.state_slot, new.state_slot]
    assert si.state_slots.dtype == np.int32


def test_round_trip_with_groups():
    out, *_ = _grouped_step()
    si = build_step_input(out, BS, LAYOUT.windows)
    back = StepInput.unpack(si.pack())
    assert back == si
    assert back.group_block_tables.shape == si.group_block_tables.shape
    back.validate(block_size=BS, num_blocks=[32, 16])


def test_single_group_defaults_and_empty_steps():
    si = StepInput.empty(4, LAYOUT.windows)
    assert si.num_kv_groups == 2 and si.group_slot_mapping.shape == (1, 0)
    assert StepInput.unpack(si.pack()) == si
    assert StepInput.empty(1).kv_group_windows.tolist() == [0]


def _valid():
    out, *_ = _grouped_step()
    return build_step_input(out, BS, LAYOUT.windows)


def _placeholder_in_window(si):
    si.group_block_tables[0, 0, 4] = PLACEHOLDER_BLOCK  # block 4 holds position 16, in the window


@pytest.mark.parametrize("mutate,match", [
    (_placeholder_in_window, "placeholder block lies inside window"),
    (lambda s: s.block_tables.__setitem__((0, 0), PLACEHOLDER_BLOCK), "non-negative"),
    (lambda s: s.group_block_tables.__setitem__((0, 0, 0), -2), ">= -1"),
    (lambda s: s.group_slot_mapping.__setitem__((0, 1), s.group_slot_mapping[0, 1] + 1),
     "slot_mapping does not match"),
    (lambda s: s.group_slot_mapping.__setitem__((0, 0), -3), "non-negative"),
    (lambda s: s.state_slots.__setitem__(1, s.state_slots[0]), "state_slots"),
    (lambda s: s.state_slots.__setitem__(1, -5), "state_slots"),
    (lambda s: s.kv_group_windows.__setitem__(1, -1), "kv_group_windows"),
    (lambda s: s.kv_group_windows.__setitem__(1, 0), "same window"),
    (lambda s: setattr(s, "kv_group_windows", np.zeros(0, np.int32)), "KV groups"),
    (lambda s: setattr(s, "group_slot_mapping", s.group_slot_mapping[:, :-1]),
     "group_slot_mapping has shape"),
    (lambda s: setattr(s, "group_block_tables", s.group_block_tables[:, :1]),
     "group_block_tables has shape"),
    (lambda s: setattr(s, "state_slots", s.state_slots.astype(np.int64)), "state_slots must be"),
    (lambda s: setattr(s, "group_block_tables", s.group_block_tables[0]), "dims"),
])
def test_validate_rejects(mutate, match):
    si = _valid()
    mutate(si)
    with pytest.raises(StepInputError, match=match):
        si.validate(block_size=BS, num_blocks=[32, 16])


def test_block_ids_checked_per_group():
    si = _valid()
    top = int(si.group_block_tables.max())
    with pytest.raises(StepInputError, match=f"num_blocks={top}"):
        si.validate(block_size=BS, num_blocks=[32, top])
    with pytest.raises(StepInputError, match="block counts"):
        si.validate(block_size=BS, num_blocks=[32])


def test_a_token_in_a_freed_block_cannot_be_built():
    out, dec, _, _ = _grouped_step()
    dec.group_block_ids(1)[20 // BS] = PLACEHOLDER_BLOCK
    with pytest.raises(ValueError, match="freed block"):
        build_step_input(out, BS, LAYOUT.windows)


def test_version_1_messages_are_refused():
    buf = bytearray(_valid().pack())
    buf[4:6] = struct.pack("<H", 1)
    with pytest.raises(StepInputError, match="version 1"):
        StepInput.unpack(bytes(buf))


def test_a_body_missing_the_new_arrays_is_refused():
    """A version-1 style body (18 arrays) under a v2 header fails on the array count."""
    body = bytearray(_valid().pack()[HEADER_SIZE:])
    body[0:4] = struct.pack("<I", 18)
    header = MessageHeader(MessageKind.STEP, 9, len(body), zlib.crc32(bytes(body)))
    sealed = header.pack() + bytes(body)
    with pytest.raises(StepInputError, match="18 arrays"):
        StepInput.unpack(sealed)
