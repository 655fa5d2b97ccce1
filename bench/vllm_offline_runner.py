"""Runs vLLM's offline ``LLM.generate`` on given token-id prompts and prints one JSON line.

Executed by the Python of a separate virtual environment that has vLLM (its pins differ from
ours), so it imports nothing of this project. Input: a JSON file
``{"model": path, "prompts": [[ids...]], "output_len": n}``; output: written to the second path
(vLLM logs to stdout), ``{"seconds": ..., "outputs": [[ids...]]}`` timed around ``generate`` only
(start-up excluded, as for the other systems).
"""

from __future__ import annotations

import json
import sys
import time


def main(path: str, out_path: str) -> None:
    with open(path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        seed=0,
        max_model_len=spec.get("max_model_len", 2048),
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm the engine once, as our warm-up does
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump({"seconds": took, "outputs": [list(o.outputs[0].token_ids) for o in outs]}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
