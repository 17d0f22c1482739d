"""Lowering passes: add_communication and merge_backward."""

from twobp.schedule import (
    Action,
    Kind,
    add_communication,
    apply_two_bp,
    generate,
    merge_backward,
    to_rows,
    validate,
)


def test_add_communication_1f1b_p2_m2():
    s = add_communication(generate("1f1b", 2, 2))
    assert to_rows(s) == [
        ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
        ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"],
    ]
    validate(s)


def test_add_communication_is_idempotent_and_keeps_the_name():
    s = add_communication(apply_two_bp(generate("zb-h1", 3, 4), "paper"))
    assert add_communication(s) == s
    assert s.name == "zb-h1+2bp:paper"


def test_no_transfer_inside_a_rank():
    # zb-v: stages 2 and 3 (p = 2: stages 1, 2 on rank 1; 0, 3 on rank 0)
    s = add_communication(generate("zb-v", 2, 2))
    validate(s)
    transfers = [a for acts in s.actions.values() for a in acts if not a.kind.is_compute]
    boundaries = {(a.stage, a.kind) for a in transfers}
    # The 1 -> 2 boundary is inside rank 1: nothing is sent across it.
    assert (1, Kind.SEND_F) not in boundaries
    assert (2, Kind.RECV_F) not in boundaries
    assert (2, Kind.SEND_B) not in boundaries
    assert (1, Kind.RECV_B) not in boundaries
    # Every other boundary crosses ranks: 2 directions x 2 ends x 2 micro-batches each.
    assert len(transfers) == 2 * 2 * 2 * 2


def test_single_rank_needs_no_communication():
    s = generate("gpipe", 1, 3, stages_per_rank=3)
    assert add_communication(s) == s


def test_merge_backward_of_a_native_split_schedule_puts_b_where_i_was():
    s = merge_backward(generate("zb-h1", 2, 2))
    assert to_rows(s) == [
        ["0F0", "0F1", "0B0", "0B1"],
        ["1F0", "1B0", "1F1", "1B1"],
    ]
    validate(s)


def test_merge_backward_splits_concatenated_w_and_keeps_communication():
    split = add_communication(apply_two_bp(generate("1f1b", 2, 3), "paper"))
    assert Action.parse("1W0-2") in split.actions[1]
    merged = merge_backward(split)
    assert merged == add_communication(generate("1f1b", 2, 3))
    validate(merged)


def test_merge_backward_of_fused_schedule_is_identity():
    s = generate("interleaved-1f1b", 2, 4)
    assert merge_backward(s) == s
