"""servex.server: the process, and everything between a caller and the executor.

A request's path, in the order a newcomer reads it:

- ``transport/``: how bytes arrive and leave: the gRPC call scope every method goes through (``rpc.py``: errors to
  statuses, metrics, deadlines), the gRPC port's listeners and TLS, the REST server (``http.py``, aiohttp), and the
  wire codecs (``tensors.py``: TensorProto <-> NumPy; ``json_codec.py``: JSON <-> NumPy). It knows no protocol.
- ``protocols/``: thin adapters, one subpackage per protocol (``tfserving/``, ``kserve/``, ``servex/``): decode the
  request, call the core, encode the answer. Protocols never import each other.
- ``core.py``: the ServingCore, the one data plane under every protocol: resolve model, version and signature,
  check inputs against the signature, and hand the run to ``servex.executor``. It imports no protocol.

Around them: the process at the top (``cli.py`` parses the command line, ``app.py`` loads models and starts the
ports, ``supervisor.py`` runs several serving processes (``group.py``: each one's link to it), ``warmup.py``
replays a version's warm-up records, ``cores.py`` and ``affinity.py`` size and pin threads, ``healthcheck.py`` is
the ``servex-health`` probe);
``config/``, the settings and the TensorFlow Serving and Triton command lines; ``observability/``, metrics.
"""
