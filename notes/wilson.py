"""The Wilson score interval of a binomial proportion, shared by the notes' scripts (seqz_v2_blind_read.py,
seqz_v2_size_quality.py). Each script rounds and scales the bounds in its own committed format."""
import math


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """Wilson score interval for k successes in n trials (z = 1.96: 95%); None when n is 0."""
    if n == 0:
        return None
    p, d = k / n, 1 + z * z / n
    c, h = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def wilson_rounded(k: int, n: int, *, scale: float = 1.0, digits: int = 4) -> list:
    """The interval's bounds times ``scale``, rounded to ``digits``; [None, None] when n is 0 (the JSON form)."""
    ci = wilson(k, n)
    return [None, None] if ci is None else [round(scale * ci[0], digits), round(scale * ci[1], digits)]
