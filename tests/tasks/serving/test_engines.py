"""The transformers engine's turns: requests in the order they came, a version's smoke check before them."""

from __future__ import annotations

import threading
import time

from tasks.serving.engines import ComputeTurns


def test_requests_take_turns_in_order_and_a_smoke_check_goes_first() -> None:
    turns, order = ComputeTurns(), []

    def work(name: str, priority: bool = False, hold: float = 0.02) -> None:
        with turns.turn(priority):
            order.append(name)
            time.sleep(hold)

    running = threading.Thread(target=work, args=("running", False, 0.3))
    running.start()
    time.sleep(0.05)
    waiting = []
    for index in range(5):
        waiting.append(threading.Thread(target=work, args=(f"request-{index}",)))
        waiting[-1].start()
        time.sleep(0.02)
    waiting.append(threading.Thread(target=work, args=("smoke", True)))
    waiting[-1].start()
    for thread in (running, *waiting):
        thread.join(10)
    assert order == ["running", "smoke", *(f"request-{i}" for i in range(5))]
