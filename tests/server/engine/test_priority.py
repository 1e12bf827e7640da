"""Compute threads run behind the edges: lowered by nice, and the threads they start inherit it."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import threading

import numpy as np

from server.engine.priority import lower_this_thread, made_lowered
from server.scoring.pipeline import Pipeline
from server.settings import Settings
from tests.server.conftest import raw_request


def nice_of(thread_id: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, thread_id)


def test_a_lowered_maker_s_threads_inherit_its_priority_and_its_caller_keeps_its_own():
    seen = {}

    def make() -> str:
        child = threading.Thread(target=lambda: seen.setdefault("child", nice_of(threading.get_native_id())))
        child.start()
        child.join()
        return "made"

    before = nice_of(threading.get_native_id())
    assert made_lowered(make, before + 6) == "made"
    assert seen["child"] == before + 6
    assert nice_of(threading.get_native_id()) == before


def test_a_lowered_maker_raises_what_it_raised():
    def fail() -> None:
        raise KeyError("nope")

    try:
        made_lowered(fail, 5)
    except KeyError as error:
        assert error.args == ("nope",)
    else:
        raise AssertionError("made_lowered swallowed the maker's error")


def test_lowering_never_raises_a_thread_s_priority():
    seen = []

    def run() -> None:
        lower_this_thread(9)
        lower_this_thread(4)  # already lower: unchanged
        seen.append(nice_of(threading.get_native_id()))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [max(9, nice_of(threading.get_native_id()))]


def test_a_cpu_server_s_runners_decoders_and_onnxruntime_pools_run_lowered(tiny_model_path):
    here = nice_of(threading.get_native_id())
    chosen = dataclasses.replace(Settings(), warm_up=False, intra_op_threads=2, compute_nice=here + 7)
    pipeline = Pipeline([tiny_model_path], settings=chosen)
    try:
        assert pipeline.score(raw_request(np.zeros((96, 128, 3), np.uint8), scales=[96])).top_k
        python = {thread.native_id: thread.name for thread in threading.enumerate()}
        lowered = {int(task.name) for task in pathlib.Path("/proc/self/task").iterdir()
                   if nice_of(int(task.name)) == here + 7}
        names = {python.get(task, "not Python's") for task in lowered}
        assert any(name.startswith("batcher-") for name in names)
        assert any(name.startswith("decode") for name in names)
        assert "not Python's" in names  # onnxruntime's intra-op pool, started by the lowered session maker
        assert nice_of(threading.get_native_id()) == here  # the caller's thread, as the edges', untouched
    finally:
        pipeline.close()
