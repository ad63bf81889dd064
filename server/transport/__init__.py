"""servex.server.transport: how calls arrive and answers leave, for every protocol.

``rpc.py`` is the scope of every gRPC method (a ServingError becomes its status and message, anything else
INTERNAL; each call counted and timed; deadlines and priority metadata read); ``listeners.py`` serves one gRPC port
from several grpc.aio servers; ``reception.py`` lets gRPC read a message only once it fits a memory limit; ``tls.py``
reads TensorFlow Serving's SSLConfig and servex's PEM flags; ``http.py`` is the REST server (aiohttp), to which each
protocol adds its routes (``compression.py`` compresses its answers); ``tensors.py`` (TensorProto) and
``json_codec.py`` (JSON) turn wire tensors into NumPy arrays and back. Nothing here imports a protocol.
"""
