"""Make the repository root and the shared test helpers (``tests/tiny_models.py``) importable from every
test folder, also when pytest runs without the package installed."""

import sys
from pathlib import Path

for _path in (Path(__file__).resolve().parents[1], Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
