"""Judging two served configurations of one model against each other.

Free-running greedy text of a random tiny model is no criterion: its top logits are nearly tied, so mere
bf16 reordering flips tokens (docs/design.md §3). Teacher-forced log-probabilities of fixed texts do not drift:
each position is scored on the same prefix. So configurations are compared by the per-token |Δ logprob|
of fixed texts, against a noise floor measured in the same run.
"""

from __future__ import annotations

from dataclasses import dataclass

import requests

# Serve with no plugin at all: stock vLLM, as the dense twins must be.
PLUGINS_OFF = {"VLLM_PLUGINS": ""}

# Fixed texts: English, Japanese, code, and words the tokenizer has never merged.
TEXTS = [
    "After Monday comes Tuesday, and the month after March is April.",
    "月曜日の次は火曜日です。一の次は二。",
    "def add(a, b):\n    return a + b\n",
    "The purple owl sleeps under the green tree while zebras quietly hum.",
]


def prompt_logprobs(url: str, text: str, model: str = "tiny") -> list[float]:
    """Log-probability of every token of `text` after the first, given the tokens before it."""
    r = requests.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": text, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0})
    r.raise_for_status()
    entries = r.json()["choices"][0]["prompt_logprobs"]
    out = []
    for entry in entries[1:]:  # the first token has no context
        # With prompt_logprobs=0 each entry holds exactly the actual token's logprob.
        (info,) = entry.values()
        out.append(float(info["logprob"]))
    return out


@dataclass
class Difference:
    mean: float
    max: float
    tokens: int

    def __str__(self) -> str:
        return f"mean |Δlogprob| {self.mean:.4f}, max {self.max:.4f} over {self.tokens} tokens"


def logprob_difference(url_a: str, url_b: str, texts: list[str] = TEXTS) -> Difference:
    diffs: list[float] = []
    for text in texts:
        a, b = prompt_logprobs(url_a, text), prompt_logprobs(url_b, text)
        assert len(a) == len(b), "the two servers tokenized a text differently"
        diffs.extend(abs(x - y) for x, y in zip(a, b))
    return Difference(mean=sum(diffs) / len(diffs), max=max(diffs), tokens=len(diffs))


def tolerance(floor: Difference) -> tuple[float, float]:
    """(mean, max) |Δlogprob| allowed between two configurations that should compute the same function.

    Our ternary maths runs in float32 and rounds once to bf16, the dense twin rounds its weights to bf16:
    they may differ by a few times the bf16 noise floor, never by more.
    """
    return 4 * floor.mean + 0.01, 4 * floor.max + 0.05


def greedy_tokens(url: str, prompt: str, n: int, model: str = "tiny") -> tuple[list[int], list[float]]:
    """Greedy token ids and, for each, the margin between the top-1 and top-2 logprob."""
    r = requests.post(url + "/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "logprobs": 2,
        "ignore_eos": True, "return_token_ids": True})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    margins = []
    for top in choice["logprobs"]["top_logprobs"]:
        vals = sorted(top.values(), reverse=True)
        margins.append(vals[0] - vals[1] if len(vals) > 1 else float("inf"))
    return choice["token_ids"], margins
