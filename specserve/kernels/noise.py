"""Uniform noise as a function of (key, index): what a seeded request samples each position with.

``uniform_noise(key, n)`` is element i = (the top 23 bits of splitmix64(key + (i + 1) * golden)
+ 0.5) / 2^23, in (0, 1). Counter-based (no generator state), exact integer arithmetic: the C
kernel (ss_uniform_noise) and the torch fallback give the same bits, so a seeded request's text
does not depend on which one ran. The C loop is several times faster than torch's Mersenne
Twister over a 152K-token vocabulary, which a seeded request draws once per output position.
"""

from __future__ import annotations

import torch

from .library import _check, _select

GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MASK64 = (1 << 64) - 1


def uniform_noise(key: int, n: int, *, impl: str | None = None) -> torch.Tensor:
    """[n] float32 uniforms in (0, 1) for a 64-bit ``key``."""
    key &= MASK64
    lib = _select(impl)
    if lib is None:
        return _uniform_torch(key, n)
    out = torch.empty(n, dtype=torch.float32)
    _check(lib.ss_uniform_noise(key, n, out.data_ptr()), "uniform_noise")
    return out


def _signed(v: int) -> int:
    """A uint64 constant as the int64 with its bits (torch's int64 arithmetic wraps as uint64's)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _uniform_torch(key: int, n: int) -> torch.Tensor:
    z = torch.arange(1, n + 1, dtype=torch.int64) * _signed(GOLDEN) + _signed(key)
    z = (z ^ _shr(z, 30)) * _signed(MIX1)
    z = (z ^ _shr(z, 27)) * _signed(MIX2)
    z = z ^ _shr(z, 31)
    return (_shr(z, 41).to(torch.float32) + 0.5) * (1.0 / 8388608.0)
