"""The design card's folders stay at the top of the repository and install beneath one import package, servex:
``server/`` as ``servex.server``, ``executor/`` as ``servex.executor``, and so on. Nothing else lands at the top of
site-packages. Everything else about the distribution is in pyproject.toml."""

from setuptools import find_packages, setup

PARTS = ("server", "executor", "loader", "transfer", "protos")

setup(
    packages=[
        "servex",
        *(f"servex.{part}{sub}" for part in PARTS for sub in ["", *(f".{p}" for p in find_packages(part))]),
    ],
    package_dir={"servex": "servex", **{f"servex.{part}": part for part in PARTS}},
)
