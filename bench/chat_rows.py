"""How many rows mlx_lm's own ``KVCache`` holds after the eval's follow-up chat, against the tokens the chat saw.

The eval's ``--equal-bytes`` share divides by the bytes the full cache holds, and mlx_lm's ``KVCache`` grows in
steps of 256 rows; ``usage.velox`` (and ``VELOX_QUANT_KEEP=0.125x``) count the rows seen instead. This prints both for
each chat (``harness.chat``, the eval's own turns) so the two shares can be put side by side.
"""

from __future__ import annotations

import argparse

from mlx_lm import load

from veloxpatch.eval import harness, ruler, sharing
from veloxpatch.eval.variants import variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--facts", type=int, default=2, choices=(2, 3))
    parser.add_argument("--prefill-step", type=int, default=256, help="as the eval's run used (its journal's key)")
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    full = variants(["full"], [1.0])[0]
    spec = harness.EvalSpec(["followup"], [args.context], [1.0], samples=args.samples, prefill_step=args.prefill_step)
    print("seed  tokens seen  rows held  held / seen")
    for seed in range(args.samples):
        caches = full.caches(model, 0)
        item = ruler.followup(tokenizer, args.context, seed, facts=args.facts)
        harness.chat(model, tokenizer, caches, item, spec, {}, sharing.fresh_reading())
        seen, held = caches[0].offset, caches[0].keys.shape[2]
        print(f"{seed:4d}  {seen:11d}  {held:9d}  {held / seen:11.3f}")


if __name__ == "__main__":
    main()
