"""The core board (``worker/core_board.py``): what a colocated worker posts about its cores is what its neighbours
read, in the same process or another; a post of a process that is gone, or of nobody, reads as None. Real files in
a temporary directory."""

from __future__ import annotations

import math
import multiprocessing
import os

from worker.core_board import CoreBoard, CorePost


def test_a_post_is_read_back_by_the_neighbour(tmp_path) -> None:
    owner = CoreBoard((1,), (), str(tmp_path))
    reader = CoreBoard((0,), (1,), str(tmp_path))
    assert reader.read(1) is None, "nobody posted yet"
    owner.post(prompt_tokens=300, decoding=2, pause_until=123.5)
    assert reader.read(1) == CorePost(os.getpid(), 300, 2, 123.5)
    assert not reader.read(1).idle
    owner.post(0, 0)
    post = reader.read(1)
    assert post is not None and post.idle and post.pause_until == math.inf
    owner.clear()
    assert reader.read(1) is None, "a withdrawn post reads as nobody's"
    owner.close()
    reader.close()


def test_an_owner_of_several_cores_posts_for_each(tmp_path) -> None:
    owner = CoreBoard((2, 3), (), str(tmp_path))
    reader = CoreBoard((0,), (2, 3), str(tmp_path))
    owner.post(10, 1, 5.0)
    assert reader.read(2) == reader.read(3) == CorePost(os.getpid(), 10, 1, 5.0)
    owner.close()
    reader.close()


def _post_and_exit(directory: str) -> None:
    CoreBoard((4,), (), directory).post(0, 0)


def test_the_post_of_a_process_that_is_gone_reads_as_none(tmp_path) -> None:
    p = multiprocessing.get_context("spawn").Process(target=_post_and_exit, args=(str(tmp_path),))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    reader = CoreBoard((0,), (4,), str(tmp_path))
    assert os.path.getsize(tmp_path / "core-4.post") > 0, "the other process posted nothing"
    assert reader.read(4) is None, "an idle post of a dead worker would lend a core nobody owns"
    reader.close()
