"""The one error of data preparation (data/datasets.py, data/reasoning_gym.py, data/prompts.py)."""
from __future__ import annotations

from common.errors import BadInput

__all__ = ["DataError"]


class DataError(BadInput):
    """Bad or missing data; the message is one line naming the file/line/field."""
