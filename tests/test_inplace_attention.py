"""bench/inplace_attention.py (issue 30's in-place kernel probe) compares its C kernel with the
cache's own decode on the cache's step tables: the two must keep computing the same attention
as the cache changes, or its figures compare nothing."""

from __future__ import annotations

import shutil

import pytest

from bench.inplace_attention import compile_kernel, row

NO_CC = shutil.which("cc") is None and shutil.which("gcc") is None
# Compiling the kernel is a subprocess.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(NO_CC, reason="no C compiler to build the probe's kernel")]


@pytest.mark.parametrize("shape", [(1, 3, 5, 17, 2, 2, 8), (3, 2, 19, 4, 1, 3, 24)])
def test_the_probes_kernel_computes_the_caches_attention(tmp_path, shape):
    r = row(compile_kernel(tmp_path), *shape)
    assert r["max_abs_diff"] < 1e-5
    assert r["cache_decode_us"] > 0 and r["inplace_c_us"] > 0
