"""The model veloxpatch ships: a plain mlx_lm folder that loads offline and retrieves a passkey.

The issue's bar: >= 95% passkey retrieval with the full cache at the training context (1024 tokens), on held-out
seeds. These 20 seeds were never used in training or to pick the checkpoint; the committed model gets 20/20 here
(98/100 on seeds 1000-1099, train/README.md).
"""

from __future__ import annotations

import subprocess

from conftest import run_python, without_velox
from test_launcher import LAUNCHER

CONTEXT = 1024
SEEDS = range(2000, 2020)  # held-out text, seeds never used in training or in docs/results.md's eval
BAR = 0.95


def test_loads_offline_with_mlx_lm() -> None:
    code = ("import mlx_lm, veloxpatch.assets as a; m, t = mlx_lm.load(str(a.model_path()));"
            "print(type(m).__module__, t.eos_token)")
    result = run_python(code, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["mlx_lm.models.llama", "<|endoftext|>"]


RETRIEVE = """
import sys
from mlx_lm import generate, load
from veloxpatch.assets import model_path
from veloxpatch.eval import tasks
model, tokenizer = load(str(model_path()))
right = 0
for seed in range(int(sys.argv[1]), int(sys.argv[2])):
    prompt, answer = tasks.passkey_example(tokenizer, int(sys.argv[3]), seed, "heldout")
    right += tasks.is_correct(generate(model, tokenizer, prompt, max_tokens=6), answer)
print(right)
"""


def test_retrieves_the_passkey_with_the_full_cache() -> None:
    """Plain mlx_lm (no method) in a child started by ``veloxpatch run``, as a user would: the launcher
    preloads the system OpenBLAS where there is one, which makes these 20 prompts several times faster."""
    result = subprocess.run([LAUNCHER, "run", "-c", RETRIEVE, str(SEEDS.start), str(SEEDS.stop), str(CONTEXT)],
                            capture_output=True, text=True, timeout=300, env=without_velox())
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[-1]) / len(SEEDS) >= BAR
