"""The relay of rank output: prefixes, live progress bars, rank filters, no two ranks on one line."""

import io

import pytest

from accel.sim.runtime import output
from accel.sim.runtime.output import OutputRelay, OutputSettings


def relay(world_size=2, ranks=None, prefix=True):
    out, err = io.StringIO(), io.StringIO()
    return OutputRelay(world_size, (out, err), OutputSettings(ranks, prefix)), out, err


def test_whole_lines_get_the_rank_prefix_and_partial_lines_wait_for_their_end():
    r, out, err = relay()
    r.feed(0, 0, b"hello\nwor")
    assert out.getvalue() == "[rank 0] hello\n"
    r.feed(1, 1, b"oops\n")
    assert err.getvalue() == "[rank 1] oops\n"
    r.feed(0, 0, b"ld\n\n")
    assert out.getvalue() == "[rank 0] hello\n[rank 0] world\n[rank 0] \n"
    r.feed(0, 0, b"no newline at the end", final=True)
    assert out.getvalue().endswith("[rank 0] no newline at the end\n")


def test_a_progress_bar_is_redrawn_in_place_as_it_comes():
    r, out, _ = relay()
    r.feed(0, 0, b"\r  0%|   | 0/3")
    assert out.getvalue() == "\r[rank 0]   0%|   | 0/3"  # shown before its line ends
    r.feed(0, 0, b"\r 33%|#  | 1/3")
    r.feed(0, 0, b"\r100%|###| 3/3\n")
    assert out.getvalue() == "\r[rank 0]   0%|   | 0/3\r[rank 0]  33%|#  | 1/3\r[rank 0] 100%|###| 3/3\n"


def test_erase_line_codes_come_before_the_prefix():
    r, out, _ = relay()
    r.feed(0, 1, b"")
    r.feed(0, 0, b"\r\x1b[2Kbar 50%")
    assert out.getvalue() == "\r\x1b[2K[rank 0] bar 50%"
    r.feed(1, 0, b"\x1b[?25hdone\n")
    assert out.getvalue().endswith("\n\x1b[?25h[rank 1] done\n")


def test_another_rank_never_writes_on_an_unfinished_bar_line():
    r, out, err = relay()
    r.feed(0, 0, b"\r 50%")
    r.feed(1, 0, b"a line\n")
    r.feed(0, 0, b"\r100%\n")
    assert out.getvalue() == "\r[rank 0]  50%\n[rank 1] a line\n\r[rank 0] 100%\n"
    r.feed(0, 1, b"\rerr bar")
    r.feed(1, 0, b"x\n")
    assert err.getvalue() == "\r[rank 0] err bar\n"  # ended on its own stream
    assert out.getvalue().endswith("[rank 1] x\n")


def test_the_filter_shows_only_some_ranks_and_one_rank_needs_no_prefix():
    r, out, _ = relay(world_size=4, ranks=frozenset({0}), prefix=None)
    r.feed(0, 0, b"mine\n")
    r.feed(1, 0, b"not shown\n")
    assert out.getvalue() == "mine\n"
    r, out, _ = relay(world_size=4, ranks=frozenset({1, 3}), prefix=None)
    r.feed(1, 0, b"a\n")
    r.feed(3, 0, b"b\n")
    r.feed(2, 0, b"c\n")
    assert out.getvalue() == "[rank 1] a\n[rank 3] b\n"
    r, out, _ = relay(world_size=1, prefix=None)
    r.feed(0, 0, b"alone\n")
    assert out.getvalue() == "alone\n"


def test_characters_split_between_reads_are_decoded_whole():
    r, out, _ = relay()
    data = "é €\n".encode()
    r.feed(0, 0, data[:1])
    r.feed(0, 0, data[1:4])
    r.feed(0, 0, data[4:])
    assert out.getvalue() == "[rank 0] é €\n"


def test_rank_filters_parse_as_torchrun_writes_them():
    assert output.parse_ranks("0") == {0}
    assert output.parse_ranks("0,2") == {0, 2}
    assert output.parse_ranks("1-3,7") == {1, 2, 3, 7}
    for bad in ("a", "3-1", "-1", "0,,1"):
        with pytest.raises(ValueError, match="rank filter"):
            output.parse_ranks(bad)


def test_settings_are_process_wide():
    before = output.settings()
    try:
        output.configure(ranks=[2], prefix=None)
        assert output.settings() == OutputSettings(frozenset({2}), None)
        r = OutputRelay(3, (io.StringIO(), io.StringIO()))
        assert r.shows(2) and not r.shows(0)
    finally:
        output.configure(before.ranks, before.prefix)
