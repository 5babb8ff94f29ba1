# SPDX-License-Identifier: Apache-2.0
"""vllm_hidden_states.tools.serve.build_command: the ``vllm serve`` argv and env.

The tiny model is never built: either a model path is given, or the builder is
replaced by a stand-in that only returns a path.
"""

import sys

import pytest

from vllm_hidden_states.tools import serve, tiny_models
from vllm_hidden_states.tools.serve import TINY_NAME, build_command

MODEL = "/models/some-model"


def flag_value(argv: list[str], flag: str) -> str:
    """The value after ``flag`` (asserting it occurs exactly once)."""
    assert argv.count(flag) == 1, (flag, argv)
    return argv[argv.index(flag) + 1]


def occurrences(argv: list[str], flag: str) -> int:
    return sum(1 for a in argv if a == flag or a.startswith(flag + "="))


@pytest.fixture
def tiny_model_stub(monkeypatch, tmp_path):
    """Replace the tiny-model builder; returns the calls it received."""
    calls = []

    def build_tiny_model(path, arch):
        calls.append((path, arch))
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text('{"hidden_size": 8}')  # all serve reads
        return path

    monkeypatch.setattr(tiny_models, "build_tiny_model", build_tiny_model)
    monkeypatch.setattr(serve, "models_dir", lambda: tmp_path)
    return calls


# --------------------------------------------------------------------------
# the command itself


def test_command_runs_vllm_serve_on_the_model_with_this_interpreter():
    argv, _ = build_command(MODEL, 8000, [], cuda=True)
    assert argv[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", MODEL]


def test_command_enables_steering_by_default():
    argv, _ = build_command(MODEL, 8000, [], cuda=True)
    assert argv.count("--enable-steering") == 1


def test_the_tiny_model_gets_a_named_example_steering_vector(tiny_model_stub, tmp_path):
    from safetensors.numpy import load_file

    argv, _ = build_command(None, 8000, [], cuda=False)
    directory = flag_value(argv, "--steering-vectors")
    vector = load_file(f"{directory}/example.safetensors")["v"]
    assert vector.shape == (8,) and vector.dtype.name == "float32"


def test_command_passes_the_port():
    argv, _ = build_command(MODEL, 8123, [], cuda=True)
    assert flag_value(argv, "--port") == "8123"


def test_command_enables_hidden_states_by_default():
    argv, _ = build_command(MODEL, 8000, [], cuda=True)
    assert argv.count("--enable-hidden-states") == 1


def test_command_does_not_repeat_enable_hidden_states_given_by_the_user():
    argv, _ = build_command(MODEL, 8000, ["--enable-hidden-states"], cuda=True)
    assert argv.count("--enable-hidden-states") == 1


def test_user_args_come_last_and_unchanged():
    extra = ["--hidden-states-layers=-1,-2", "--seed", "3"]
    argv, _ = build_command(MODEL, 8000, extra, cuda=True)
    assert argv[-3:] == extra


def test_a_given_model_gets_no_tiny_model_defaults():
    argv, _ = build_command(MODEL, 8000, [], cuda=True)
    assert "--served-model-name" not in argv
    assert "--dtype" not in argv
    assert "--max-model-len" not in argv


# --------------------------------------------------------------------------
# CUDA vs CPU defaults


def test_with_cuda_there_are_no_cpu_defaults_and_no_env():
    argv, env = build_command(MODEL, 8000, [], cuda=True)
    assert "--gpu-memory-utilization" not in argv
    assert env == {}


def test_without_cuda_gpu_memory_utilization_defaults_to_0_3():
    argv, _ = build_command(MODEL, 8000, [], cuda=False)
    assert flag_value(argv, "--gpu-memory-utilization") == "0.3"


def test_without_cuda_max_model_len_defaults_to_2048():
    argv, _ = build_command(MODEL, 8000, [], cuda=False)
    assert flag_value(argv, "--max-model-len") == "2048"


def test_without_cuda_the_env_sets_a_1_gib_cpu_kv_cache():
    _, env = build_command(MODEL, 8000, [], cuda=False)
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1"}


def test_a_user_flag_with_equals_is_not_duplicated():
    argv, _ = build_command(MODEL, 8000, ["--max-model-len=4096"], cuda=False)
    assert occurrences(argv, "--max-model-len") == 1
    assert "--max-model-len=4096" in argv
    assert "2048" not in argv


def test_a_user_flag_with_a_separate_value_is_not_duplicated():
    argv, _ = build_command(MODEL, 8000, ["--gpu-memory-utilization", "0.5"], cuda=False)
    assert occurrences(argv, "--gpu-memory-utilization") == 1
    assert flag_value(argv, "--gpu-memory-utilization") == "0.5"


def test_a_flag_sharing_a_prefix_does_not_count_as_given():
    argv, _ = build_command(MODEL, 8000, ["--max-model-len-extra=1"], cuda=False)
    assert flag_value(argv, "--max-model-len") == "2048"


# --------------------------------------------------------------------------
# the tiny default model (builder stubbed)


def test_without_a_model_the_tiny_qwen3_is_built_under_models_dir(tiny_model_stub, tmp_path):
    argv, _ = build_command(None, 8000, [], cuda=True)
    assert tiny_model_stub == [(tmp_path / TINY_NAME, "qwen3")]
    assert argv[4] == str(tmp_path / TINY_NAME)


def test_the_tiny_model_is_served_as_tiny_qwen3(tiny_model_stub):
    argv, _ = build_command(None, 8000, [], cuda=True)
    assert TINY_NAME == "tiny-qwen3"
    assert flag_value(argv, "--served-model-name") == "tiny-qwen3"


def test_the_tiny_model_runs_in_float32_with_a_2048_context(tiny_model_stub):
    argv, _ = build_command(None, 8000, [], cuda=True)
    assert flag_value(argv, "--dtype") == "float32"
    assert flag_value(argv, "--max-model-len") == "2048"
    assert argv.count("--enable-hidden-states") == 1


def test_the_tiny_model_on_cpu_gives_max_model_len_once(tiny_model_stub):
    argv, env = build_command(None, 8000, [], cuda=False)
    assert flag_value(argv, "--max-model-len") == "2048"
    assert flag_value(argv, "--gpu-memory-utilization") == "0.3"
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1"}


def test_the_tiny_model_defaults_yield_to_user_flags(tiny_model_stub):
    extra = ["--served-model-name", "mine", "--dtype=bfloat16"]
    argv, _ = build_command(None, 8000, extra, cuda=False)
    assert occurrences(argv, "--served-model-name") == 1
    assert occurrences(argv, "--dtype") == 1
    assert flag_value(argv, "--served-model-name") == "mine"
