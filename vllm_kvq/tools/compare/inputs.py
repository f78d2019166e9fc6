"""The inputs every engine gets (made once by the parent, run.make_inputs): greedy prompts
cut from held-out text windows, and passkey prompts of exact lengths."""
from __future__ import annotations

import random

from vllm_kvq.tools.corpus import held_out_windows


PASSKEY_HEADER = ("There is an important info hidden inside a lot of irrelevant text. "
                  "Find it and memorize it. I will quiz you about the important "
                  "information there.\n")
PASSKEY_FILLER = ("The grass is green. The sky is blue. The sun is yellow. "
                  "Here we go. There and back again. ")
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
PASSKEY_NEW_TOKENS = 8
GREEDY_TEXT_PROMPT = 384  # tokens of held-out text before a greedy continuation
GREEDY_PER_WINDOW = 4     # such prompts per window: consecutive segments of it


def passkey_items(tokenizer, lengths: list[int], positions: int | dict, seed: int = 0,
                  filler: str = "repeat") -> list[dict]:
    """Prompts of exactly `length` tokens: a 5-digit key hidden at a seeded depth of the
    filler, then the question. All prompts share one filler stream, so each reuses the
    previous ones' cached prefix up to its needle (cheap on a 2-core CPU)."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    head, question = enc(PASSKEY_HEADER), enc(PASSKEY_QUESTION)
    need = max(lengths)
    if filler == "text":
        stream: list[int] = []
        for w in held_out_windows(tokenizer, 1 + need // 2048, 2048, seed=seed + 7):
            stream += w
    else:
        unit = enc(PASSKEY_FILLER)
        stream = unit * (need // len(unit) + 2)
    rng = random.Random(seed)
    items = []
    for length in lengths:
        n = positions.get(length, positions.get(str(length))) if isinstance(positions, dict) \
            else positions
        for i in range(n):
            key = str(rng.randrange(10000, 100000))
            needle = enc(PASSKEY_NEEDLE.format(key=key))
            body = length - len(head) - len(needle) - len(question)
            if body < 16:
                raise ValueError(f"passkey length {length} is too short")
            # seeded depths, spread over the prompt: one per equal slice
            depth = (i + rng.uniform(0.1, 0.9)) / n
            pos = int(depth * body)
            ids = head + stream[:pos] + needle + stream[pos:body] + question
            assert len(ids) == length
            items.append({"length": length, "depth": round(depth, 3),
                          "needle_at": len(head) + pos, "key": key, "ids": ids})
    return items


def greedy_prompts(windows: list[list[int]]) -> list[list[int]]:
    """Up to GREEDY_PER_WINDOW consecutive segments of GREEDY_TEXT_PROMPT tokens per window:
    greedy decoding diverges at the first near-tie, so one prompt per window says little."""
    n = GREEDY_TEXT_PROMPT
    return [w[j * n:(j + 1) * n] for w in windows
            for j in range(min(GREEDY_PER_WINDOW, len(w) // n))]
