"""Helpers the test modules share (never tests themselves; no test module imports another):

- ``paths``: the project root and TensorFlow Serving's test models (re-exported by tests/conftest.py);
- ``ports``: loopback ports that cannot collide (below the ephemeral range, claimed across processes, held bound
  until the daemon starts);
- ``daemon``: ``Daemon`` (the real servex daemon as a subprocess, started again on fresh ports after a port clash;
  optionally in a spare process that has imported TensorFlow already), ``run_to_exit``, ``metric``, ``wait_for``,
  ``model_config_file``, ``listening_sockets``, ``terminate``, ``free_port``;
- ``clients``: requests with the real client libraries (``predict``, ``predict_request``, ``predict_outputs``,
  ``predict_first``, ``predict_y``, Classify/Regress/MultiInference builders, ``session_run``, ``run``,
  ``expect_error``, ``admin_stub``, tritonclient's ``infer_input`` and ``expect_inference_error``);
- ``models``: the SavedModels the tests export with TensorFlow, and warm-up files;
- ``buffers``: NumPy buffers at known alignments;
- ``fixtures``: ``start_daemon`` (module), ``shared_daemon`` (session: one daemon per set of flags), and the
  session-scoped exported models (``slow_model``, ``mlp_model``, ``sum_model``, ``strings_model``), made available
  to every test by tests/conftest.py.
"""
