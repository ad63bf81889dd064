"""Write the demo SavedModel bundled in server/demo_model (run once; its output is committed).

demo: y = 0.5 * x + 2 for a float32 vector x of any length, as TensorFlow Serving's half_plus_two, written by
TF2 with variables so that it exercises the same path as real models.

    python scripts/make_demo_model.py server/demo_model/1
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402


def main(path: str) -> None:
    module = tf.Module()
    module.a = tf.Variable(0.5, name="a")
    module.b = tf.Variable(2.0, name="b")

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def serve(x):
        return {"y": module.a * x + module.b}

    module.serve = serve
    tf.saved_model.save(module, path, signatures={"serving_default": serve})


if __name__ == "__main__":
    main(sys.argv[1])
