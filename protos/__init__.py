"""protos: the .proto sources of servex's own services and their generated Python modules.

servex's own GraphExecutor and Variable services are defined here as they arrive; TensorFlow Serving's messages
come from the `tensorflow-serving-api` package and are not copied. ``tensorflow/`` holds what TensorFlow's wheel
compiles into its C++ library but ships no Python module of (the profiler service).
"""
