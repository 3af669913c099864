import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Real request traces live beside the project (never committed into it); tests that read them
# skip when they are absent.
TRACES = os.path.join(ROOT, "..", "shared", "traces")


@pytest.fixture
def tiny_args(tmp_path):
    """A configuration small enough for an end-to-end run on CPU in a second or two."""
    return ["--device", "cpu", "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "128",
            "--dtype", "float32", "--batch-sizes", "1,4", "--context", "8", "--contexts", "8,16",
            "--prefill-lengths", "16", "--decode-batches", "1,2", "--requests", "50",
            "--slots", "4", "--warmup", "1", "--reps", "3", "--out", str(tmp_path)]
