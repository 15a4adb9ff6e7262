"""Context lookup: which copy is offered, and that a loop copies itself forward."""

import mlx.core as mx

from dflash2_mlx.loop.lookup import Lookup, one_hot_rows


def test_copy_of_what_followed_the_last_occurrence():
    l = Lookup([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert l.repeating and l.draft(5) == [4, 5, 9, 1, 2]
    # The latest earlier occurrence wins, and a 4-gram over a 3-gram.
    l = Lookup([1, 2, 3, 7, 5, 1, 2, 3, 8, 0, 1, 2, 3])
    assert l.draft(2) == [8, 0]
    l = Lookup([9, 1, 2, 3, 6, 5, 1, 2, 3, 8, 9, 1, 2, 3])
    assert l.draft(1) == [6]


def test_no_copy_without_a_repeated_trigram():
    l = Lookup([1, 2, 3, 1, 2, 4])
    assert not l.repeating and l.draft(4) == []
    assert Lookup([]).draft(3) == [] and Lookup([5, 5]).draft(3) == []


def test_a_loop_copies_itself_past_the_present():
    assert Lookup([7, 7, 7, 7]).draft(4) == [7, 7, 7, 7]
    assert Lookup([1, 2, 3, 1, 2, 3]).draft(5) == [1, 2, 3, 1, 2]


def test_extend_keeps_the_index_current():
    l = Lookup([1, 2, 3, 4])
    assert not l.repeating
    l.extend([1, 2])
    assert not l.repeating
    l.extend([3])
    assert l.repeating and l.draft(3) == [4, 1, 2]
    l.extend([5])  # the copy broke: 2, 3, 5 never occurred
    assert not l.repeating and l.draft(3) == []


def test_one_hot_rows():
    rows = one_hot_rows(mx.array([2, 0]), 4)
    assert rows.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]
