"""protos.tensorflow: TensorFlow's own services that servex serves and whose Python modules TensorFlow's wheel does
not ship: the profiler service (profiler_service.proto, ``--enable_profiler``), with TSL's full names and field
numbers; its messages import TSL's ProfileOptions and XSpace from TensorFlow's ``tensorflow.tsl`` modules."""
