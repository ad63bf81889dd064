"""A model's base path: numbered version folders, as TensorFlow Serving lays them out."""

from __future__ import annotations

import os

from servex.loader.errors import LoadError

MAX_VERSION = 2**63 - 1  # versions are int64 in TensorFlow Serving's and KServe's protos


def list_versions(base_path: str) -> dict[int, str]:
    """Map each numbered sub-folder of ``base_path`` to its path; other entries are ignored.

    Raises LoadError when the base path is missing or holds no numbered folder.
    """
    if not os.path.isdir(base_path):
        raise LoadError(f"model base path {base_path!r} does not exist or is not a directory")
    versions = {}
    for entry in os.listdir(base_path):
        full = os.path.join(base_path, entry)
        # ASCII only ('²' is no version), and within int64 as TensorFlow Serving parses them (safe_strto64): a
        # larger number is no version either (it would become the latest, then fail in every int64 field)
        if entry.isascii() and entry.isdigit() and int(entry) <= MAX_VERSION and os.path.isdir(full):
            versions[int(entry)] = full
    if not versions:
        raise LoadError(
            f"model base path {base_path!r} holds no version folder: expected numbered sub-folders "
            f"such as {os.path.join(base_path, '1')!r}, found {sorted(os.listdir(base_path))}"
        )
    return versions


def latest_version(base_path: str) -> tuple[int, str]:
    """The highest-numbered version under ``base_path`` and its path."""
    versions = list_versions(base_path)
    version = max(versions)
    return version, versions[version]


def folder_fingerprint(path: str) -> tuple:
    """Names, sizes and modification times of the files under ``path``: changes while a folder is copied."""
    entries = []
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            try:
                st = os.stat(full)
            except OSError:
                continue
            entries.append((os.path.relpath(full, path), st.st_size, st.st_mtime_ns))
    return tuple(sorted(entries))
