"""servex: a serving daemon for TensorFlow SavedModels.

One import package; its parts live in the repository's top-level folders and install beneath it:

- ``servex.server`` (``server/``): the process: CLI and settings, transports, protocol adapters, the ServingCore;
- ``servex.executor`` (``executor/``): client graphs, the priority run handler and batching, run metrics;
- ``servex.loader`` (``loader/``): SavedModels, versions, lazy restoration, variable registries;
- ``servex.transfer`` (``transfer/``): host-to-device transfer executors;
- ``servex.protos`` (``protos/``): servex's own .proto files and their generated modules.

Dependencies point one way: server -> executor -> loader, transfer.
"""
