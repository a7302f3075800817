"""nblaunch's version, where every layer may read it (a Ray agent compares it with the driver's).

``pyproject.toml`` reads it from here, so the package and the code never disagree.
"""

__version__ = "0.1.0"
