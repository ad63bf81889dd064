#!/bin/sh
# servex image entrypoint. Serves $MODEL_BASE_PATH/$MODEL_NAME as $MODEL_NAME (TensorFlow Serving's image
# convention: -e MODEL_NAME=my_model -v /host/my_model:/models/my_model), unless the arguments name the models
# themselves (--model_config_file, --model_base_path or --model_name), in which case they are passed on as they
# are. Other arguments are appended. exec: servex is PID 1 and receives SIGTERM itself, so it drains and exits 0.
set -eu
for arg in "$@"; do
    case "$arg" in
        --model_config_file|--model_config_file=*|--model_base_path|--model_base_path=*|--model_name|--model_name=*)
            exec servex "$@"
            ;;
    esac
done
exec servex "--model_name=${MODEL_NAME:-model}" "--model_base_path=${MODEL_BASE_PATH:-/models}/${MODEL_NAME:-model}" "$@"
