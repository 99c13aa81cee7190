"""``World`` options that need no rank processes to check."""

from __future__ import annotations

import pytest

from interlace.errors import InterlaceValueError
from interlace.testing import World


def test_share_device_needs_the_cuda_backend():
    with pytest.raises(InterlaceValueError, match="share_device=True needs backend='cuda'"):
        World(2, "cpu", share_device=True)
