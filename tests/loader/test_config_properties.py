"""Property tests of the text-format model configurations: TensorFlow Serving's ModelServerConfig
(loader/config.py) and Triton's config.pbtxt (loader/model_repository.py). Any message printed with text_format
(of random fields, and then with random edits), and any text at all, gives the models to serve or INVALID_ARGUMENT
naming the file, never another exception (tests/support/strategies.py)."""

from __future__ import annotations

import os

import pytest
from google.protobuf import text_format
from hypothesis import example, given
from hypothesis import strategies as st
from tensorflow_serving.config import model_server_config_pb2

from servex.loader import model_repository
from servex.loader.config import parse_model_config
from servex.loader.errors import ServingError
from servex.protos.inference import model_config_module
from tests.support.strategies import examples, mangled, messages, outcome, refused

# protobuf's text_format reads an unknown escape (a backslash before "[") with a DeprecationWarning
pytestmark = pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning")
SOURCE = "model config file '/etc/models.config'"
_WRITABLE = "/tmp/servex-config-properties"  # the test makes it: a directory request logs can go to


def _paths() -> st.SearchStrategy[str]:
    return st.sampled_from([f"{_WRITABLE}/requests", _WRITABLE, f"{_WRITABLE}/", "/nonexistent/requests",
                            "requests", f"{_WRITABLE}/a\x00b", "/proc/requests"])  # fmt: skip


SERVER_CONFIGS = messages(
    model_server_config_pb2.ModelServerConfig.DESCRIPTOR,
    depth=5,
    strings={
        "name": st.sampled_from(["m", "m", "n", ""]),
        "base_path": st.sampled_from(["/models/m", "/models/n", "", "/a\x00b"]),
        "model_platform": st.sampled_from(["", "tensorflow", "tensorflow", "pytorch"]),
        "type": st.sampled_from(["tfrecord", "tfrecord", "", "files"]),
        "filename_prefix": _paths(),
    },
)


def _text(message, edit: bool, draw) -> str:
    text = text_format.MessageToString(message, as_utf8=draw(st.booleans()))
    if draw(st.integers(0, 4)) == 0:
        text = text.replace('"m"', '"${SERVEX_TEST_UNSET}"' if draw(st.booleans()) else '"${SERVEX_TEST_NAME}"')
    return draw(mangled(text)) if edit else text


@st.composite
def config_texts(draw, strategy) -> str:
    """A message printed in text format; sometimes with a random edit, a ${VARIABLE}, or any text at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.text(max_size=40))
    return _text(draw(strategy), draw(st.booleans()), draw)


def _setup() -> None:
    os.makedirs(_WRITABLE, exist_ok=True)
    os.environ["SERVEX_TEST_NAME"] = "m"
    os.environ.pop("SERVEX_TEST_UNSET", None)


@given(config_texts(SERVER_CONFIGS))
@example('model_config_list { config { name: "m" base_path: "/m" logging_config { log_collector_config { type: '
         f'"tfrecord" filename_prefix: "{_WRITABLE}/a\\000b" }} }} }} }}')  # fmt: skip
@example("custom_model_config { [type.googleapis.com/foo.Bar] { } }")
@example('model_config_list { config { name: "\\xff" } }')
@examples(300)
def test_a_model_server_config_gives_its_models_or_invalid_argument(text):
    _setup()
    result, _ = outcome(lambda: parse_model_config(text, SOURCE, replacing=True))
    if isinstance(result, ServingError):
        refused(result, SOURCE)
        return
    config = model_server_config_pb2.ModelServerConfig()
    text_format.Parse(text.replace("${SERVEX_TEST_NAME}", "m"), config)
    models = config.model_config_list.config
    assert [(s.name, s.base_path) for s in result] == [(m.name, m.base_path) for m in models]
    for spec in result:
        assert spec.name and spec.base_path
        if spec.logging is not None:
            assert "\0" not in spec.logging.filename_prefix and 0 <= spec.logging.sampling_rate <= 1


# Deferred: the ModelConfig class is looked up when the test runs, after collection has imported tritonclient's
# (servex's inference.* protos and tritonclient's cannot both load in one process: model_config_module).
TRITON_CONFIGS = st.deferred(lambda: _triton_configs())


def _triton_configs() -> st.SearchStrategy:
    return messages(
        model_config_module().ModelConfig.DESCRIPTOR,
        depth=3,
        strings={
            "name": st.sampled_from(["m", "m", "", "other"]),
            "platform": st.sampled_from(["", "tensorflow_savedmodel", "onnxruntime_onnx"]),
            "backend": st.sampled_from(["", "tensorflow", "python"]),
            "default_model_filename": st.sampled_from(["", "model.savedmodel", "a/b", "..", "x\x00y"]),
            "string_value": st.sampled_from(["", "serving_default", "serve", "other"]),
        },
    )


@given(config_texts(TRITON_CONFIGS) | st.binary(max_size=40))
@example('default_model_filename: "x\\000y"')
@example(b"\xff\xfe")
@examples(300)
def test_a_triton_config_pbtxt_gives_its_model_or_invalid_argument(tmp_path_factory, contents):
    folder = tmp_path_factory.getbasetemp() / "repository" / "m"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / model_repository.CONFIG_FILE
    if isinstance(contents, bytes):
        path.write_bytes(contents)
    else:
        path.write_text(contents, encoding="utf-8", errors="surrogateescape")
    result, _ = outcome(lambda: model_repository.read_model("m", str(folder)))
    if isinstance(result, ServingError):
        refused(result, "model 'm'", str(path))
        return
    spec, notes = result
    assert spec.name == "m" and spec.base_path == str(folder) and all(isinstance(n, str) for n in notes)
    assert spec.model_file and "/" not in spec.model_file and "\0" not in spec.model_file
    assert spec.model_file not in (".", "..")
