"""``afore status``'s plan ring lines: a reader's liveness verdict and what the timeout means
are stated, not left to be read off a heartbeat age."""

from afore.scheduler.status_cli import format_segment


def _reader(r, state="live", alive=True, age=51.9):
    return {"reader": r, "state": state, "pid": 100 + r, "alive": alive, "heartbeat_age_s": age, "lag": 0,
            "copied": 5, "stale_skipped": 0, "missed": 0, "torn": 0, "rejected": 0, "evicted": 0, "writer_dead": False}


def _ring(readers):
    return {"name": "afore-1-plans", "kind": "plan_ring", "version": 2, "state": "ready", "owner_pid": 1,
            "owner_alive": True, "size_bytes": 4096, "compatible": True, "num_readers": len(readers), "num_slots": 8,
            "slot_capacity": 1024, "liveness_timeout_s": 1.0, "writer_heartbeat_age_s": 0.2, "writer_pid": 1,
            "writer_alive": True, "writer_timeout_s": 0.0, "counters": {"published": 5}, "readers": readers}


def test_idle_reader_is_alive_with_an_old_last_read():
    text = format_segment(_ring([_reader(0), _reader(1, age=0.01)]))
    assert "readers 2/2 alive" in text
    assert "reader 0: alive, pid 100, last read 51.900 s ago" in text
    assert "holds the writer up for 1.000 s without reading" in text
    assert "heartbeat 51.9" not in text and "liveness 1.000 s" not in text


def test_dead_and_evicted_readers_say_so():
    text = format_segment(_ring([_reader(0, alive=False), _reader(1, state="evicted", alive=False)]))
    assert "readers 0/2 alive" in text
    assert "reader 0: DEAD (process gone" in text
    assert "reader 1: evicted (rejoins at its next read)" in text
