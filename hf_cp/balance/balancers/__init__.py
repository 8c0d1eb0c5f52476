"""The built-in balancers, one module (or folder) each; each registers itself on import.

Every module of this package is imported here, so a new balancer is one file with no list to
edit (CONTRIBUTING.md).
"""

from __future__ import annotations

import pkgutil
from importlib import import_module

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    import_module(f"{__name__}.{_module}")
