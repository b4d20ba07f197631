"""Batch messages are cut to fit: ``batches`` keeps order and never puts more than its budget
in one run (an item larger than the budget goes alone)."""

from __future__ import annotations

from tangram.contract import BATCH_BYTES, MAX_MESSAGE_BYTES, Ack, DropEnv, batches, encode


def test_runs_keep_order_and_fit_the_budget():
    items = [DropEnv(trajectory_id=f"t{k:03d}" * 50, epoch=1) for k in range(100)]
    size = len(encode(items[0]))
    runs = batches(items, budget=10 * size)
    assert [i for run in runs for i in run] == items
    assert all(sum(len(encode(i)) for i in run) <= 10 * size for run in runs)
    assert len(runs) == 10


def test_a_large_item_goes_alone_and_small_lists_stay_whole():
    big = DropEnv(trajectory_id="x" * 2000, epoch=1)
    assert batches([Ack(), big, Ack()], budget=100) == [[Ack()], [big], [Ack()]]
    assert batches([Ack()]) == [[Ack()]]
    assert batches([]) == []
    assert BATCH_BYTES < MAX_MESSAGE_BYTES
