"""Keeps vLLM's offline ``LLM`` loaded and runs ``LLM.generate`` on given token-id prompts once per request.

Executed by the Python of a separate virtual environment that has vLLM (its pins differ from
ours), so it imports nothing of this project. Arguments: a JSON file
``{"model": path, "prompts": [[ids...]], "output_len": n, "dtype": ..., "max_model_len": ...,
"enable_prefix_caching": bool}`` and the number of
a file descriptor the parent passed in, on which it writes one JSON line per message (vLLM logs to stdout and
stderr, which the parent sends to a log file):

- ``{"ready": true}`` once the model is loaded and the engine warmed;
- ``{"seconds": ..., "outputs": [[ids...]]}`` for each ``run`` line read on stdin, timed around ``generate`` only
  (start-up excluded, as for the other systems).

It exits at end of input, so the parent can time several rounds against one loaded engine, alternating with its
own system's rounds.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(path: str, result_fd: int) -> None:
    with open(path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    results = os.fdopen(result_fd, "w", buffering=1)  # one line per message, flushed at its newline

    def say(message: dict) -> None:
        results.write(json.dumps(message) + "\n")

    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        seed=0,
        max_model_len=spec.get("max_model_len", 2048),
        # As the engine it is compared with: otherwise every round after the first finds its prompts cached.
        enable_prefix_caching=spec.get("enable_prefix_caching", False),
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm the engine once, as our warm-up does
    say({"ready": True})
    for line in sys.stdin:
        if line.strip() != "run":
            continue
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        took = time.perf_counter() - t0
        say({"seconds": took, "outputs": [list(o.outputs[0].token_ids) for o in outs]})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
