"""Small, offline data sets and synthetic benchmarks built from scikit-learn's digits.

Importing this package is cheap: scikit-learn is only imported when digits are first loaded.
"""

from explain_core.data.clutter import ClutteredDigits, make_cluttered_digits
from explain_core.data.digits import CLASS_NAMES, DigitsSplit, load_digits
from explain_core.data.grids import MultiImageGrids, make_multi_image_grids

__all__ = [
    "CLASS_NAMES",
    "ClutteredDigits",
    "DigitsSplit",
    "MultiImageGrids",
    "load_digits",
    "make_cluttered_digits",
    "make_multi_image_grids",
]
