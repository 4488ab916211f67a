"""Capture cost: durations of the span itself, never negative, even on a loaded host."""

import threading
import time

import torch

from lightning_cafin.monitor.capture_cost import CaptureCost


def test_durations_of_the_span_under_load():
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            sum(i * i for i in range(2000))

    threads = [threading.Thread(target=busy, daemon=True) for _ in range(3)]
    for th in threads:
        th.start()
    try:
        cost = CaptureCost(torch.device("cpu"))
        for i in range(20):
            cost.start()
            time.sleep(0.001 * (i % 3))
            cost.stop()
    finally:
        stop.set()
        for th in threads:
            th.join()
    device_ms, host_ms = cost.drain()
    assert len(host_ms) == 20 and device_ms == host_ms  # on the CPU both are the wall clock
    assert min(host_ms) >= 0 and max(host_ms[2::3]) >= 2.0
    assert cost.drain() == ([], [])


def test_stop_without_start_records_nothing():
    cost = CaptureCost(torch.device("cpu"))
    cost.stop()
    assert cost.pending == 0
