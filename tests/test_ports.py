"""Side-channel port reservations never clash, within a process or across processes."""

from __future__ import annotations

import socket
import subprocess
import sys

from duet.kv_transfer.ports import reserve_ports


def test_reservations_in_one_process_do_not_clash():
    first = reserve_ports("127.0.0.1", 46100, count=2)
    second = reserve_ports("127.0.0.1", 46100, count=2)
    try:
        assert {first.base_port, first.base_port + 1}.isdisjoint({second.base_port, second.base_port + 1})
    finally:
        first.release()
        second.release()


def test_released_ports_are_reused():
    first = reserve_ports("127.0.0.1", 46200)
    port = first.base_port
    first.release()
    again = reserve_ports("127.0.0.1", 46200)
    assert again.base_port == port
    again.release()


def test_port_bound_by_another_program_is_skipped():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        reservation = reserve_ports("127.0.0.1", port)
        assert reservation.base_port != port
        reservation.release()


def test_reservation_held_by_another_process_is_skipped():
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "from duet.kv_transfer.ports import reserve_ports; import sys, time\n"
         "r = reserve_ports('127.0.0.1', 46300); print(r.base_port, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        held = int(holder.stdout.readline())
        mine = reserve_ports("127.0.0.1", 46300)
        assert mine.base_port != held
        mine.release()
    finally:
        holder.kill()
        holder.wait()
    # The kernel dropped the dead process's lock: the port is free again.
    after = reserve_ports("127.0.0.1", held)
    assert after.base_port == held
    after.release()
