"""Chi-square goodness of fit with a real p-value (torch.special.gammaincc, no SciPy)."""
import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of observing `counts` (any shape) under `probs` (same shape, sums to 1).

    Cells with expected count below min_expected are pooled into one cell. A cell of
    probability 0 with a nonzero count gives p = 0 (an impossible outcome happened).
    """
    counts = counts.flatten().to(torch.float64)
    probs = probs.flatten().to(torch.float64)
    n = counts.sum()
    if (counts[probs == 0] > 0).any():
        return 0.0
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    dof = obs.numel() - 1
    if dof < 1:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))
