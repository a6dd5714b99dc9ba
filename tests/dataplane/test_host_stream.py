"""The CPU's stand-in for a communication stream (``host_stream.py``, single process)."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from ultraep_megatron.dataplane import HostCommStream


def test_host_comm_stream_runs_in_order_reports_errors_and_ends_with_its_owner():
    stream = HostCommStream()
    order = []
    futures = [
        stream.submit(lambda i=i: (time.sleep(0.01 * (3 - i)), order.append(i), i * i)[-1])
        for i in range(3)
    ]
    failed = stream.submit(lambda: 1 / 0)
    assert [f.result(timeout=10) for f in futures] == [0, 1, 4]  # each task's own result
    assert order == [0, 1, 2]  # in order, whatever each takes
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=10)
    assert threading.get_ident() not in {stream.submit(threading.get_ident).result(timeout=10)}
    thread = stream._thread
    del stream, futures, failed
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
