"""servex.server.protocols.tfserving: TensorFlow Serving's APIs over the ServingCore.

``grpc_api.py``: PredictionService (Predict, Classify, Regress, MultiInference, GetModelMetadata), ModelService and
SessionService; ``rest_api.py``: the REST API (``/v1/models/...``), answering as TensorFlow Serving's
http_rest_api_handler does; ``examples.py``: Classify, Regress and MultiInference over tf.Examples, shared by both;
``request_logging.py``: which of their calls a model's ``logging_config`` logs, and the PredictionLog records'
request and response messages.
"""
