"""The policy board of ``--planner workers``: afore serve posts a policy switch, FFN workers read it."""

from __future__ import annotations

import os

import pytest

from afore.scheduler.policy_board import NAME_BYTES, PolicyBoard, PolicyReader


def _name(tag: str) -> str:
    return f"afore-test-board-{tag}-{os.getpid()}"


def test_readers_see_each_switch_once_in_epoch_order():
    board = PolicyBoard(_name("order"), "afore")
    a, b = PolicyReader(board.name), PolicyReader(board.name)
    try:
        assert a.changed() == (1, "afore") and a.changed() is None
        assert board.set("eplb") == 2 and board.set("static") == 3
        assert a.changed() == (3, "static") and a.changed() is None  # the newest switch, once
        assert b.changed() == (3, "static")
        board.set("x" * NAME_BYTES)
        assert a.changed() == (4, "x" * NAME_BYTES)
    finally:
        a.close()
        b.close()
        board.close()
    assert not os.path.exists(f"/dev/shm/{board.name}")


def test_bad_names_and_segments_are_refused():
    board = PolicyBoard(_name("bad"), "afore")
    try:
        for bad in ("", "x" * (NAME_BYTES + 1)):
            with pytest.raises(ValueError, match="policy: expected a name of 1 to 64 bytes"):
                board.set(bad)
        assert board.epoch == 1  # a refused post changes nothing
    finally:
        board.close()
    with pytest.raises(FileNotFoundError):
        PolicyReader(_name("absent"))
    path = f"/dev/shm/{_name('junk')}"
    with open(path, "wb") as fh:
        fh.write(b"\0" * 200)
    try:
        with pytest.raises(ValueError, match="not a policy board"):
            PolicyReader(_name("junk"))
    finally:
        os.unlink(path)
    with pytest.raises(ValueError, match="name: expected a segment name"):
        PolicyBoard("a/b", "afore")
