"""The model suite on the CPU (benchmarks/suite.py, suite_models.py): every model of
transformers' and timm's lists in torch.compile's benchmark harness and torchvision's
classics, at a tiny size, trained one step and run in inference under plait.jit, its
result, loss and every gradient checked against a float64 eager reference as the suite
checks them. Dropout is off here (the suite's ``--dropout-seeds`` checks a model's own
dropout; tests/test_randomness.py checks every dropout path by its statistics)."""
import os
import sys

import pytest

pytestmark = pytest.mark.slow

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
try:
    import suite_models  # noqa: E402

    suite_models.import_torchvision()
    import timm  # noqa: F401, E402
    import transformers  # noqa: F401, E402
    import suite  # noqa: E402
except ImportError as e:  # the `suite` extra, which `make test-slow` installs
    if os.environ.get("PLAIT_SUITE_REQUIRED") == "1":  # set by `make test-slow`
        raise
    pytest.skip(f"the model suite's libraries are not installed ({e})",
                allow_module_level=True)


@pytest.mark.parametrize("mode", ["train", "infer"])
@pytest.mark.parametrize("name", sorted(suite.SUITE))
def test_suite_model(name, mode):
    eager, plait = suite.run(name, mode, "float32", "cpu", ("eager", "plait"), rounds=0)
    assert eager.status == "pass", f"eager fails on the CPU: {eager.reason}"  # none does
    assert plait.status == "pass", plait.reason


@pytest.mark.parametrize("mode", ["train", "infer"])
@pytest.mark.parametrize("name", ["timm_resnet50", "tv_convnext_tiny"])
def test_suite_model_in_channels_last_memory(name, mode):
    """A vision model as training scripts run it: parameters and images channels-last
    (NOTE [strided arguments]: the weights are read where they lie)."""
    eager, plait = suite.run(name, mode, "float32", "cpu", ("eager", "plait"), rounds=0,
                             channels_last=True)
    assert (eager.status, plait.status) == ("pass", "pass"), plait.reason
    assert plait.model == name + suite.CHANNELS_LAST


def test_training_is_bitwise_reproducible_across_processes():
    """benchmarks/determinism.py on the CPU: two processes, three steps each, one hash of
    the loss and of every gradient per step (NOTE [deterministic programs])."""
    import subprocess

    import determinism

    script = os.path.join(os.path.dirname(suite.__file__), "determinism.py")
    done = subprocess.run([sys.executable, script, "--models", "DistilBertForMaskedLM",
                           "--columns", "plait", "--processes", "2"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["DistilBertForMaskedLM", "plait", "reproducible"]
    # and a difference is found where there is one
    same = [{"loss": "a", "w": "b"}] * 3
    assert determinism.verdict([same, same]) == "reproducible"
    assert determinism.verdict([same, same[:2] + [{"loss": "a", "w": "c"}]]) == \
        "differs: process 1 step 2: w"
