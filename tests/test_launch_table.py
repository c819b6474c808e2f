"""The launch table gives the SGMV and BGMV launchers, for every shape, the parameters of the
rules it replaced. The expected values below are those rules' outputs over a grid of shapes
around every bound they had, recorded once, and those of the classes tuned since; the table must
keep to them on ``sm90`` (and, having no other tuned entry yet, on ``default``)."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fxlora.kernels import launch_table

SHRINK_KINDS = {  # block_m, block_k, num_warps, block_r, num_stages, rows_last
    "a": (16, 256, 2, 32, 1, True),
    "b": (16, 128, 1, 32, 2, True),
    "c": (16, 128, 1, 16, 1, True),
    "d": (16, 128, 2, 64, 3, False),
    "e": (64, 64, 4, 64, 3, False),
    "f": (64, 64, 8, 256, 3, False),
    "g": (16, 256, 1, 16, 2, True),
    "h": (16, 256, 2, 16, 1, True),
}
SHRINK_KS = (32, 1024, 4096, 8191, 8192)
# ranks: every slice's rank rows; slices: the output slices of the GEMM beside the shrink
SHRINK = """
tokens ranks slices kind and split_k at k = 32 1024 4096 8191 8192
     1    16      1     a1   a4  a16  a16  a16
     1    16      3     a1   a4  a16  a16  a16
     1    64      1     a1   a4  a16  a16  a16
     1    64      3     a1   a4  a16  a16  a16
     1    65      1     a1   a4  a16  a16  a16
     1    65      3     a1   a4  a16  a16  a16
     1   256      1     a1   a4  a16  a16  a16
     1   256      3     a1   a4  a16  a16  a16
     8    16      1     a1   a4  a16  a16  a16
     8    16      3     a1   a4  a16  a16  a16
     8    64      1     a1   a4  a16  a16  a16
     8    64      3     a1   a4  a16  a16  a16
     8    65      1     a1   a4  a16  a16  a16
     8    65      3     a1   a4  a16  a16  a16
     8   256      1     a1   a4  a16  a16  a16
     8   256      3     a1   a4  a16  a16  a16
     9    16      1     h1   h4   h8   h8  g32
     9    16      3     c1   c8  c32  c32  c32
     9    48      1     h1   h4   h8   h8  g32
     9    48      3     c1   c8  c32  c32  c32
     9    49      1     b1   b8  b16  b16  b16
     9    49      3     c1   c8  c32  c32  c32
     9    64      1     b1   b8  b16  b16  b16
     9    64      3     c1   c8  c32  c32  c32
     9    65      1     b1   b8  b16  b16  b16
     9    65      3     b1   b8  b16  b16  b16
     9   256      1     b1   b8  b16  b16  b16
     9   256      3     b1   b8  b16  b16  b16
    32    16      1     h1   h4   h8   h8  g32
    32    16      3     c1   c8  c32  c32  c32
    32    64      1     b1   b8  b16  b16  b16
    32    64      3     c1   c8  c32  c32  c32
    32    65      1     b1   b8  b16  b16  b16
    32    65      3     b1   b8  b16  b16  b16
    32   256      1     b1   b8  b16  b16  b16
    32   256      3     b1   b8  b16  b16  b16
    33    16      1     h1   h4   h8   h8  g32
    33    16      3     a1   a4  a16  a16  a16
    33    64      1     b1   b8  b16  b16  b16
    33    64      3     a1   a4  a16  a16  a16
    33    65      1     b1   b8  b16  b16  b16
    33    65      3     a1   a4  a16  a16  a16
    33   256      1     b1   b8  b16  b16  b16
    33   256      3     a1   a4  a16  a16  a16
    48    16      1     h1   h4   h8   h8  g32
    48    16      3     a1   a4  a16  a16  a16
    48    64      1     b1   b8  b16  b16  b16
    48    64      3     a1   a4  a16  a16  a16
    48    65      1     b1   b8  b16  b16  b16
    48    65      3     a1   a4  a16  a16  a16
    48   256      1     b1   b8  b16  b16  b16
    48   256      3     a1   a4  a16  a16  a16
    64    16      1     h1   h4   h8   h8  g32
    64    16      3     a1   a4  a16  a16  a16
    64    48      1     h1   h4   h8   h8  g32
    64    48      3     a1   a4  a16  a16  a16
    64    49      1     b1   b8  b16  b16  b16
    64    49      3     a1   a4  a16  a16  a16
    64    64      1     b1   b8  b16  b16  b16
    64    64      3     a1   a4  a16  a16  a16
    64    65      1     b1   b8  b16  b16  b16
    64    65      3     a1   a4  a16  a16  a16
    64   256      1     b1   b8  b16  b16  b16
    64   256      3     a1   a4  a16  a16  a16
    65    16      1     d1   d8   d8   d8   d8
    65    16      3     c1   c8  c32  c32  c32
    65    64      1     d1   d8   d8   d8   d8
    65    64      3     c1   c8  c32  c32  c32
    65    65      1     d1   d8   d8   d8   d8
    65    65      3     d1   d8   d8   d8   d8
    65   256      1     d1   d8   d8   d8   d8
    65   256      3     d1   d8   d8   d8   d8
   128    16      1     d1   d8   d8   d8   d8
   128    16      3     c1   c8  c32  c32  c32
   128    64      1     d1   d8   d8   d8   d8
   128    64      3     c1   c8  c32  c32  c32
   128    65      1     d1   d8   d8   d8   d8
   128    65      3     d1   d8   d8   d8   d8
   128   256      1     d1   d8   d8   d8   d8
   128   256      3     d1   d8   d8   d8   d8
   512    16      1     d1   d8   d8   d8   d8
   512    16      3     c1   c8  c32  c32  c32
   512    64      1     d1   d8   d8   d8   d8
   512    64      3     c1   c8  c32  c32  c32
   512    65      1     d1   d8   d8   d8   d8
   512    65      3     d1   d8   d8   d8   d8
   512   256      1     d1   d8   d8   d8   d8
   512   256      3     d1   d8   d8   d8   d8
   513    16      1     e1   e8   e8   e8   e8
   513    16      3     e1   e8   e8   e8   e8
   513    64      1     e1   e8   e8   e8   e8
   513    64      3     e1   e8   e8   e8   e8
   513    65      1     f1   f4   f4   f4   f4
   513    65      3     f1   f4   f4   f4   f4
   513   256      1     f1   f4   f4   f4   f4
   513   256      3     f1   f4   f4   f4   f4
  4096    16      1     e1   e8   e8   e8   e8
  4096    16      3     e1   e8   e8   e8   e8
  4096    64      1     e1   e8   e8   e8   e8
  4096    64      3     e1   e8   e8   e8   e8
  4096    65      1     f1   f4   f4   f4   f4
  4096    65      3     f1   f4   f4   f4   f4
  4096   256      1     f1   f4   f4   f4   f4
  4096   256      3     f1   f4   f4   f4   f4
"""

EXPAND_KINDS = {  # block_m, block_n, num_warps, tiles, stages, rows_last
    "a": (16, 128, 4, 1, 2, True),
    "b": (16, 256, 4, 1, 2, True),
    "c": (16, 128, 4, 1, 2, False),
    "d": (16, 256, 4, 1, 2, False),
    "e": (16, 256, 4, 4, 2, False),
    "f": (128, 64, 8, 4, 2, False),
    "g": (64, 64, 4, 4, 2, False),
    "h": (64, 64, 4, 8, 2, False),
}
EXPAND_SEGMENTS = (1, 4, 5, 16, 17)
EXPAND_SLICES = (1, 3)
EXPAND = """
tokens rank  kind at segments 1 4 5 16 17, with 1 slice then with 3
     1   16   aaaaa  aaaaa
     1   32   aaaaa  aaaaa
     1   33   bbbbb  bbbbb
     1   64   bbbbb  bbbbb
     1  128   bbbbb  bbbbb
    64   16   aaaaa  aaaaa
    64   32   aaaaa  aaaaa
    64   33   bbbbb  bbbbb
    64   64   bbbbb  bbbbb
    64  128   bbbbb  bbbbb
    65   16   ccccc  ccccc
    65   32   ccccc  ccccc
    65   33   ddddd  ddddd
    65   64   ddddd  ddddd
    65  128   ddddd  ddddd
   512   16   ccccc  ccccc
   512   32   ccccc  ccccc
   512   33   ddddd  ddddd
   512   64   ddddd  ddddd
   512  128   ddddd  ddddd
   513   16   eeeee  eeeee
   513   32   eeeee  eeeee
   513   33   ffggg  hhhhh
   513   64   ffggg  hhhhh
   513  128   ffggg  hhhhh
  2048   16   eeeee  eeeee
  2048   32   eeeee  eeeee
  2048   33   ffffg  hhhhh
  2048   64   ffffg  hhhhh
  2048  128   ffffg  hhhhh
  4096   16   eeeee  eeeee
  4096   32   eeeee  eeeee
  4096   33   fffff  hhhhh
  4096   64   fffff  hhhhh
  4096  128   fffff  hhhhh
"""

# per-token expand: the most tokens it serves at each max rank, and its parameters by tokens
TOKEN_EXPAND_MOST_TOKENS = {0: 64, 1: 64, 8: 64, 16: 64, 17: 16, 32: 16, 64: 16, 65: 7, 128: 4, 256: 2, 512: 1, 1024: 0}
TOKEN_EXPAND = {1: (64, 4), 4: (64, 4), 5: (128, 2), 32: (128, 2), 33: (256, 2), 64: (256, 2), 2048: (256, 2)}


def _rows(table: str):
    return [line.split() for line in table.strip().splitlines()[1:]]


@pytest.fixture(params=["sm90", "default"])
def device_table(request, monkeypatch):
    monkeypatch.setattr(launch_table, "device_key", lambda device: request.param)
    return request.param


def test_shrink_configs(device_table):
    for tokens, ranks, slices, *cells in _rows(SHRINK):
        for k, (kind, split) in zip(SHRINK_KS, [(cell[0], cell[1:]) for cell in cells], strict=True):
            config = launch_table.shrink_config(int(tokens), k, int(ranks), int(slices))
            block_m, block_k, num_warps, block_r, num_stages, rows_last = SHRINK_KINDS[kind]
            expected = launch_table.ShrinkConfig(
                block_m, block_k, int(split), num_warps, block_r, num_stages, rows_last
            )
            assert config == expected, (tokens, k, ranks, slices)


def test_expand_configs(device_table):
    for tokens, rank, *kinds in _rows(EXPAND):
        for slices, row in zip(EXPAND_SLICES, kinds, strict=True):
            for segments, kind in zip(EXPAND_SEGMENTS, row, strict=True):
                config = launch_table.expand_config(int(tokens), int(rank), segments, slices)
                expected = launch_table.ExpandConfig(*EXPAND_KINDS[kind])
                assert config == expected, (tokens, rank, segments, slices)


def test_wide_outputs_take_four_tiles_at_decode_sizes(device_table):
    four = launch_table.ExpandConfig(16, 128, 4, tiles=4)
    for tokens, rank, columns in ((65, 16, 8192), (128, 32, 14336), (512, 16, 28672)):
        assert launch_table.expand_config(tokens, rank, 16, 2, columns) == four
    for tokens, rank, columns in ((64, 16, 14336), (128, 16, 8191), (128, 33, 14336), (513, 16, 14336)):
        assert launch_table.expand_config(tokens, rank, 16, 2, columns) != four, (tokens, rank, columns)


def test_many_short_segments_past_512_tokens_take_small_row_blocks(device_table):
    """An MoE block's token-expert pairs, a (slot, expert) segment per pair or two: past 512
    tokens the shrink takes 16-row blocks of one warp there, the prefill rows elsewhere."""
    small = launch_table.ShrinkConfig(16, 64, 8, 1)
    assert launch_table.shrink_config(1024, 2048, 16, segments=1024) == small
    assert launch_table.shrink_config(1024, 768, 64, segments=512) == small
    assert launch_table.shrink_config(1024, 256, 16, segments=1024) == dataclasses.replace(small, split_k=4)  # k // block_k
    for tokens, ranks, segments in ((1024, 16, 511), (1024, 65, 1024), (256, 16, 256), (4096, 16, 1024)):
        plain = launch_table.shrink_config(tokens, 2048, ranks)
        assert launch_table.shrink_config(tokens, 2048, ranks, segments=segments) == plain != small, (tokens, ranks, segments)


def test_token_expand(device_table):
    for rank, most in TOKEN_EXPAND_MOST_TOKENS.items():
        served = [t for t in range(1, 300) if launch_table.token_expand_serves(t, rank)]
        assert served == list(range(1, most + 1)), rank
    for tokens, expected in TOKEN_EXPAND.items():
        assert dataclasses.astuple(launch_table.token_expand_config(tokens)) == expected


def test_every_list_ends_with_a_class_for_any_shape():
    for table in launch_table.TABLES.values():
        for rows in (table.shrink, table.expand, table.token_expand):
            assert rows[-1][0] == launch_table.When()


def test_other_devices_take_the_default_table():
    assert launch_table.device_key(None) == "default"
    assert launch_table.device_key(torch.device("cpu")) == "default"


@given(a=st.integers(0, 2**40), b=st.integers(1, 2**20), n=st.integers(1, 2**40))
def test_host_arithmetic_agrees_with_tritons(a, b, n):
    triton = pytest.importorskip("triton")
    assert launch_table.cdiv(a, b) == triton.cdiv(a, b)
    assert launch_table.next_power_of_2(n) == triton.next_power_of_2(n)
