"""Troubleshooting hints are pure functions of the reply numbers."""

from edgerun.decode.stats import ReplyStats
from edgerun.tui import hints


def _reply(drafted, accepted):
    s = ReplyStats()
    s.drafted, s.accepted = drafted, accepted
    return s


def test_low_acceptance_over_a_while_suggests_turning_the_draft_off():
    out = hints.after_reply([_reply(20, 5), _reply(20, 6)], 100, 4096)
    assert len(out) == 1 and "not helping" in out[0] and "F3" in out[0]


def test_one_short_unlucky_reply_is_not_enough():
    assert hints.after_reply([_reply(10, 1)], 100, 4096) == []


def test_good_acceptance_and_room_left_say_nothing():
    assert hints.after_reply([_reply(50, 40)], 100, 4096) == []


def test_context_nearly_full():
    out = hints.after_reply([], 3600, 4096)
    assert len(out) == 1 and "3600/4096" in out[0] and "Ctrl+N" in out[0]
