"""loader: what is served.

Owns reading SavedModels (TF1 and TF2, tag ``serve``) into a graph and session with their signatures, the
layout of numbered version folders under a model's base path, Triton model repositories
(loader/model_repository.py: folders with a config.pbtxt), a version's warm-up records
(loader/warmup_records.py), the ModelManager that keeps the served versions, and the ServingError types every
layer raises. It imports neither `server/` nor `executor/`.
"""

from servex.loader.errors import InvalidArgument, LoadError, NotFound, PermissionDenied, ServingError
from servex.loader.manager import ModelManager, ServedVersion
from servex.loader.saved_model import SavedModelVersion, Signature, TensorSpec, load_saved_model
from servex.loader.versions import latest_version, list_versions

__all__ = [
    "InvalidArgument",
    "LoadError",
    "ModelManager",
    "NotFound",
    "PermissionDenied",
    "SavedModelVersion",
    "ServedVersion",
    "ServingError",
    "Signature",
    "TensorSpec",
    "latest_version",
    "list_versions",
    "load_saved_model",
]
